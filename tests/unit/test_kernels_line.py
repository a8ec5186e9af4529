"""training/kernels.py: TF32 for fp32 matmuls on CUDA only (--no-tf32 turns it off), the CPU
untouched; the start-up `kernels:` line names the attention backend torch's dispatcher picks,
the optimizer kernel and the fp32 matmul mode (tools/gpu_check.py reads it)."""
import pytest
import torch

from megatron_2bw.config import Config
from megatron_2bw.pretrain import parse
from megatron_2bw.training import kernels as K

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--vocab-size", "128", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--mock-data", "--attention-dropout", "0"]


@pytest.fixture
def restore_precision():
    matmul = torch.backends.cuda.matmul.fp32_precision
    conv = torch.backends.cudnn.conv.fp32_precision
    yield
    torch.backends.cuda.matmul.fp32_precision = matmul
    torch.backends.cudnn.conv.fp32_precision = conv


def test_tf32_is_set_for_cuda_and_never_for_the_cpu(restore_precision):
    before = torch.get_float32_matmul_precision()
    K.configure_math(Config(), "cpu")
    assert K.fp32_matmul("cpu") == "ieee" and torch.get_float32_matmul_precision() == before
    K.configure_math(Config(), "cuda:0")   # the flags only: no GPU is touched
    assert K.fp32_matmul("cuda:0") == "tf32"
    assert torch.backends.cudnn.conv.fp32_precision == "tf32"
    K.configure_math(Config().replace(precision={"tf32": False}), "cuda:0")
    assert K.fp32_matmul("cuda:0") == "ieee"
    assert torch.get_float32_matmul_precision() == before  # CPU matmuls stay IEEE fp32


def test_no_tf32_flag():
    assert parse("gpt", TINY)[0].precision.tf32
    assert not parse("gpt", TINY + ["--no-tf32"])[0].precision.tf32


def test_the_kernels_line():
    cfg = parse("gpt", TINY)[0]
    line = K.kernels_line(cfg, 1, "cpu", "torch-fused")
    assert line == ("megatron-2bw: kernels: attention flash, optimizer torch-fused, "
                    "fp32 matmul ieee")
    # the dispatcher's answer changes with what the backends can take: math once flash is off
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
        assert K.attention_backend(cfg, 1, "cpu") == "math"
    # the training step's dropout counts: torch's CPU flash attention takes none
    assert K.attention_backend(cfg.replace(model={"attention_dropout": 0.1}), 1, "cpu") == "math"
    bert = cfg.replace(model={"family": "bert"})
    assert K.attention_backend(bert, 2, "cpu") in K.BACKENDS.values()
