"""Which math a run's hot kernels use, set once at start-up and said in one log line.

    megatron-2bw: kernels: attention flash, optimizer torch-fused, fp32 matmul tf32

- fp32 matmul: on CUDA the pretrain scripts put fp32 matmuls and convolutions on TF32 tensor
  cores (`--no-tf32`: IEEE fp32), as most GPU training stacks do; bf16/fp16 matmuls are not
  affected. The CPU keeps IEEE fp32 whatever the flag (TF32 is a GPU format; CPU runs stay
  bitwise comparable with the single-process references).
- attention: the backend torch's scaled-dot-product dispatcher picks for this rank's attention
  shape, dtype and device (`torch._fused_sdp_choice`, the function `F.scaled_dot_product_attention`
  itself asks): flash, cudnn, efficient or math.
- optimizer: the kernel that steps this rank's optimizer (`--optimizer-impl`, resolved by
  optim/kernels.py for the device; the engine's optimizer says which).

tools/gpu_check.py reads the line and also checks the profiler trace for what really ran.
"""
from __future__ import annotations

import torch

from megatron_2bw.config import Config

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BACKENDS = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}


def configure_math(cfg: Config, device) -> None:
    """TF32 for fp32 matmuls and convolutions on a CUDA `device` per `cfg.precision.tf32`."""
    if torch.device(device).type != "cuda":
        return
    mode = "tf32" if cfg.precision.tf32 else "ieee"
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    if hasattr(matmul, "fp32_precision"):  # torch >= 2.9: the per-backend precision API
        matmul.fp32_precision = mode
        cudnn.conv.fp32_precision = mode
    else:
        matmul.allow_tf32 = cudnn.allow_tf32 = cfg.precision.tf32


def fp32_matmul(device) -> str:
    """"tf32" or "ieee": what an fp32 matmul on `device` runs as now."""
    if torch.device(device).type != "cuda":
        return "ieee"
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        mode = matmul.fp32_precision
        if mode == "none":  # not set per backend: the global setting decides
            return "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"
        return mode
    return "tf32" if matmul.allow_tf32 else "ieee"


def attention_backend(cfg: Config, tensor_parallel: int, device) -> str:
    """The scaled-dot-product backend torch picks for one microbatch of this rank's heads."""
    m = cfg.model
    heads = m.num_attention_heads // tensor_parallel
    groups = max(m.query_groups // tensor_parallel, 1)
    shape = (cfg.batch.micro_batch_size, heads, m.seq_length, m.kv_channels)
    dtype = _DTYPES[cfg.precision.dtype]
    q = torch.empty(shape, dtype=dtype, device=device)
    kv = torch.empty((shape[0], groups, *shape[2:]), dtype=dtype, device=device)
    causal = m.family != "bert" and not m.reset_attention_mask  # else an attn_mask, no causal
    mask = None if causal else torch.ones(shape[0], 1, m.seq_length if m.reset_attention_mask
                                          else 1, m.seq_length, dtype=torch.bool, device=device)
    extra = {"enable_gqa": True} if groups != heads else {}
    try:  # in training: the attention dropout (some backends, e.g. the CPU's flash, take none)
        choice = torch._fused_sdp_choice(q, kv, kv, mask, m.attention_dropout, causal, **extra)
    except (RuntimeError, TypeError, AttributeError):  # an older torch, or no backend fits
        return "unknown"
    return BACKENDS.get(int(choice), "unknown")


def kernels_line(cfg: Config, tensor_parallel: int, device, optimizer_impl: str) -> str:
    """The start-up line (the module docstring); `optimizer_impl`: the engine optimizer's."""
    impl = optimizer_impl
    return (f"megatron-2bw: kernels: attention {attention_backend(cfg, tensor_parallel, device)}"
            f", optimizer {impl}, fp32 matmul {fp32_matmul(device)}")
