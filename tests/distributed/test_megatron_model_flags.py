"""Megatron's model flags of issue 34 (--kv-channels, --apply-layernorm-1p, --qk-layernorm) on real
gloo processes: the pipelined, tensor-parallel run equals the single-process reference
(testing/verify.py, fp32, rtol 1e-5), so their gradients (the q/k norms' summed over the tensor
ranks) and their weight decay are right."""
import pytest

from megatron_2bw.testing.verify import parse, run

FLAGS = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
         "--micro-batch-size 2 --train-iters 3 --global-batch-size 8 --weight-decay 0.1 "
         "--kv-channels 16 --apply-layernorm-1p --qk-layernorm --normalization RMSNorm "
         "--position-embedding-type rope --swiglu --lr 1e-2").split()


@pytest.mark.parametrize("t,d,extra", [
    (2, 2, ["--sequence-parallel"]),
    pytest.param(1, 2, [], marks=pytest.mark.slow)], ids=["t2d2-sp", "t1d2"])
def test_megatron_model_flags_match_the_reference(t, d, extra):
    cfg, _ = parse(["--schedule", "2bw", "--tensor-model-parallel-size", str(t),
                    "--pipeline-model-parallel-size", str(d)] + FLAGS + extra)
    m = cfg.model
    assert m.kv_channels == 16 and m.apply_layernorm_1p and m.qk_layernorm
    rep = run(cfg, timeout_minutes=2)
    assert rep.passed(1e-5), rep
    assert rep.tied_equal and rep.replicas_equal and not rep.problems
