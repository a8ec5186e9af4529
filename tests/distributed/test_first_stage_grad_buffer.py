"""Issue 32: `--2bw-grad-buffers first` (one fp32 gradient buffer on stage 0, two on the others)
on gloo processes equals the 2BW delayed-update reference (fp32, rtol 1e-5) at d=2 and d=4, with
the distributed optimizer and with a compensation; its losses and weights are bitwise those of
two buffers (bf16 too), and a two-buffer checkpoint continues in it bitwise."""
import tempfile

import pytest
import torch

from test_one_grad_buffer import flags as one_buffer_flags
from test_resume import make_cfg, newest_weights, run as run_training
from megatron_2bw.pipeline.engine import PipelineEngine
from megatron_2bw.testing.verify import parse, run

FIRST = ["--2bw-grad-buffers", "first"]


def flags(d, w, *extra):
    return one_buffer_flags(d, w, *extra, mode=FIRST)


class FirstStageOneBufferEngine(PipelineEngine):
    """The engine, checking that stage 0 holds one gradient buffer and the others two."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        w = self.weights
        if self.stage == 0:
            assert w.grad_buffers == 1 and w.grads[0] is w.grads[1] and w.separate_losses
        else:
            assert w.grad_buffers == 2 and w.grads[0] is not w.grads[1]


@pytest.mark.parametrize("d,w,extra", [
    pytest.param(4, 1, (), id="d4"),
    pytest.param(2, 2, ("--use-distributed-optimizer",), id="d2w2-distopt"),
    pytest.param(2, 1, (), id="d2", marks=pytest.mark.slow),
    pytest.param(2, 2, ("--2bw-compensation", "predict"), id="d2w2-predict",
                 marks=pytest.mark.slow),
    pytest.param(4, 2, ("--2bw-compensation", "predict-nesterov",
                        "--use-distributed-optimizer"), id="d4w2-nesterov-distopt",
                 marks=pytest.mark.slow)])
def test_first_stage_one_buffer_matches_the_2bw_reference(d, w, extra):
    cfg, _ = parse(flags(d, w, *extra))
    assert cfg.grad_buffers == "first"
    rep = run(cfg, timeout_minutes=1, engine_class=FirstStageOneBufferEngine)
    assert rep.passed(1e-5), rep
    assert rep.clipped_steps > 0 and rep.tied_equal and rep.replicas_equal


@pytest.mark.parametrize("precision", [[], ["--bf16"]], ids=["fp32", "bf16"])
def test_first_stage_one_buffer_trains_bitwise_like_two_and_continues_a_two_buffer_run(precision):
    with tempfile.TemporaryDirectory() as d:
        def go(name, *argv):
            return run_training(make_cfg(["--train-iters", "4", "--save", f"{d}/{name}",
                                          *precision, *argv]), f"{d}/{name}.losses")
        two = go("two")
        assert go("first", *FIRST) == two
        for a, b in zip(newest_weights(f"{d}/two"), newest_weights(f"{d}/first")):
            assert torch.equal(a["newest"], b["newest"])
        head = go("resumed", "--save-interval", "2", "--exit-interval", "2")
        assert head + go("resumed", *FIRST, "--load", f"{d}/resumed") == two
