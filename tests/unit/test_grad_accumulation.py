"""Issue 32, point 2: bf16/fp16 backward accumulates into the fp32 gradient buffer directly
(--grad-accumulation fp32, the default, Megatron's main_grad) with no stage-sized low-precision
gradient; the old low-precision buffer stays as --grad-accumulation buffer. Both give bitwise
the same fp32 gradients; the memory model, the pre-launch check and the config know both."""
import copy

import pytest
import torch

from megatron_2bw.config import ConfigError
from megatron_2bw.config.build import build_config
from megatron_2bw.pipeline.weights import VersionedWeights
from megatron_2bw.planner.memory import state_bytes
from megatron_2bw.planner.memory_check import stage_estimates
from megatron_2bw.pretrain import build_parser


def _stage():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.LayerNorm(6), torch.nn.Linear(6, 8))


def _backwards(w: VersionedWeights, slot: int, n: int = 3) -> None:
    """n microbatches' backwards on `slot`'s module, the engine's fold after each."""
    torch.manual_seed(1)
    for _ in range(n):
        x = torch.randn(4, 8, dtype=w.dtype)
        # the module is used twice per microbatch: autograd sums both uses per parameter
        out = w.modules[slot](x) + w.modules[slot](x * 0.5)
        out.float().square().mean().backward()
        w.fold_model_grad(slot)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("grad_buffers", [None, 1])
def test_fp32_accumulation_equals_the_low_precision_buffer_bitwise(dtype, grad_buffers):
    stage = _stage()
    hooked = VersionedWeights(copy.deepcopy(stage), 2, dtype, "cpu", grad_buffers=grad_buffers)
    folded = VersionedWeights(copy.deepcopy(stage), 2, dtype, "cpu", grad_buffers=grad_buffers,
                              grad_accumulation="buffer")
    assert hooked.model_grad is None and folded.model_grad is not None
    for w in (hooked, folded):
        _backwards(w, 1)
    assert torch.equal(hooked.grads[1], folded.grads[1])
    assert float(hooked.grads[1].abs().sum()) > 0
    for p in hooked.modules[1].parameters():  # no low-precision gradient is left behind
        assert p.grad is None
    if grad_buffers is None:  # slot 0's buffer saw nothing
        assert float(hooked.grads[0].abs().sum()) == 0
    _backwards(hooked, 0)  # the other version's module adds into its own buffer
    _backwards(folded, 0)
    assert torch.equal(hooked.grads[0], folded.grads[0])


def test_fp32_runs_are_unchanged_by_the_mode():
    w = VersionedWeights(_stage(), 2, "fp32", "cpu")
    assert w.model_grad is None
    for k in (0, 1):  # .grad views of the slot's fp32 buffer, as before
        assert all(p.grad is not None and p.grad.untyped_storage().data_ptr()
                   == w.grads[k].untyped_storage().data_ptr() for p in w.modules[k].parameters())
    with pytest.raises(ValueError, match="grad_accumulation must be one of"):
        VersionedWeights(_stage(), 1, "bf16", "cpu", grad_accumulation="bf16")


@pytest.mark.parametrize("mode", ["fp32", "buffer"])
def test_the_memory_model_counts_the_mode(mode):
    w = VersionedWeights(_stage(), 2, "bf16", "cpu", grad_accumulation=mode)
    model = state_bytes(w.numel, 2, "bf16", "adam", grad_accumulation=mode)
    held = 0 if w.model_grad is None else w.model_grad.numel() * w.model_grad.element_size()
    assert model["model_grad"] == held == (2 * w.numel if mode == "buffer" else 0)
    assert state_bytes(w.numel, 2, "fp32", "adam", grad_accumulation=mode)["model_grad"] == 0


def _per_param(schedule_slots, shards, grad_buffers=None, mode="fp32", n=10 ** 8):
    b = state_bytes(n, schedule_slots, "bf16", "adam", shards=shards, grad_buffers=grad_buffers,
                    grad_accumulation=mode)
    return sum(b.values()) / n


@pytest.mark.parametrize("w", [1, 4, 8])
def test_bytes_per_parameter_are_megatron_s_plus_one_version(w):
    """bf16, Adam, bytes per parameter of a stage (the README's table): flush/gpipe 6 + 12/w as
    Megatron-LM documents (18 without the distributed optimizer), 2BW with one gradient buffer
    one bf16 version more: 8 + 12/w (20); the low-precision buffer adds 2 to each."""
    # the buffers' tails and each slot's loss element, and the shard padding: at most w - 1
    # elements per region (3 reduction buckets of Megatron's 40M here) of at most 24 bytes
    tail = 1e-6 + 3 * (w - 1) * 24 / 10 ** 8
    assert _per_param(1, w) == pytest.approx(6 + 12 / w, abs=tail)
    assert _per_param(2, w, grad_buffers=1) == pytest.approx(8 + 12 / w, abs=tail)
    assert _per_param(2, w) == pytest.approx(12 + 12 / w, abs=tail)  # two buffers: 4 more
    assert _per_param(1, w, mode="buffer") == pytest.approx(8 + 12 / w, abs=tail)


BASE = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--pipeline-model-parallel-size", "2", "--global-batch-size", "4"]


def _cfg(*argv):
    return build_config(build_parser("gpt").parse_args(BASE + list(argv)), "gpt", 2).config


def test_the_flag_reaches_the_config_and_the_pre_launch_check():
    assert _cfg("--bf16").precision.grad_accumulation == "fp32"
    fold = _cfg("--bf16", "--grad-accumulation", "buffer")
    assert fold.precision.grad_accumulation == "buffer"
    hooked, buffered = stage_estimates(_cfg("--bf16"), 2), stage_estimates(fold, 2)
    for a, b in zip(hooked, buffered):
        assert a["model_grad"] == 0 and b["model_grad"] > 0
        assert b["total"] - a["total"] == b["model_grad"]


def test_a_low_precision_buffer_in_an_fp32_run_is_refused_in_one_line():
    with pytest.raises(ConfigError) as e:
        _cfg("--grad-accumulation", "buffer")
    msg = str(e.value)
    assert "--grad-accumulation buffer" in msg and "--bf16" in msg and "\n" not in msg
    with pytest.raises(SystemExit):  # argparse names the choices
        _cfg("--bf16", "--grad-accumulation", "bf16")
