"""Megatron's --decoupled-lr / --decoupled-min-lr on real gloo processes: the input embedding and
the output layer (both copies of the tied word embedding) step at their own lr, on the same warmup
and decay, and every layout equals the single-process reference in plain PyTorch with those
parameters in param groups of their own (megatron_2bw/testing/reference.py; Adam, clipping
active, fp32, rtol 1e-5): flush and 2bw at t=1/d=2, with the distributed optimizer, untied, and
under 2BW's compensation (whose predictions use the lr); an engine that steps every parameter at
--lr fails the comparison; a resume with the distributed optimizer is bitwise exact."""
import pytest

from megatron_2bw.pipeline.engine import PipelineEngine
from megatron_2bw.testing.verify import parse, run

from test_distributed_optimizer import resume_is_bitwise

TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --train-iters 5 --clip-grad 0.3 --optimizer adam --lr 2e-3 "
        "--min-lr 2e-4 --lr-warmup-iters 2 --lr-decay-style cosine --lr-decay-iters 5 "
        "--decoupled-lr 1e-2 --decoupled-min-lr 5e-4 --hidden-dropout 0 --attention-dropout 0 "
        "--timeout-minutes 1").split()


def flags(schedule, d, w, *extra):
    return (["--schedule", schedule, "--pipeline-model-parallel-size", str(d),
             "--data-parallel-size", str(w), "--global-batch-size", str(2 * 4 * w)]
            + TINY + list(extra))


@pytest.mark.parametrize("schedule,w,extra", [
    ("flush", 1, ()),
    ("2bw", 2, ("--use-distributed-optimizer",)),
    ("flush", 2, ("--use-distributed-optimizer", "--untie-embeddings-and-output-weights")),
    ("2bw", 1, ("--2bw-compensation", "predict-spike")),
    ("2bw", 2, ("--2bw-compensation", "predict-nesterov", "--use-distributed-optimizer")),
], ids=["flush-d2w1", "2bw-d2w2-distopt", "flush-d2w2-distopt-untied", "2bw-d2w1-spike",
        "2bw-d2w2-distopt-nesterov"])
def test_decoupled_lr_matches_the_two_group_reference(schedule, w, extra):
    cfg, _ = parse(flags(schedule, 2, w, *extra))
    assert cfg.optimizer.decoupled_lr == 1e-2
    rep = run(cfg, timeout_minutes=1)
    assert rep.passed(1e-5), rep
    assert rep.clipped_steps > 0 and rep.tied_equal and rep.replicas_equal


class IgnoresDecoupledLR(PipelineEngine):
    """A broken engine, defined here and passed in: every parameter steps at --lr (the
    decoupled lr's schedule replaced by the plain one)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stepper.rates = self.stepper.compensation.lr = self.stepper.lr


def test_checker_catches_an_engine_that_ignores_the_decoupled_lr():
    cfg, _ = parse(flags("2bw", 2, 1))
    rep = run(cfg, timeout_minutes=1, engine_class=IgnoresDecoupledLR)
    assert not rep.passed(1e-5) and rep.max_rel_diff > 1e-3, rep
    assert "embedding" in rep.worst or "head" in rep.worst or "layers.0" in rep.worst, rep


def test_resume_with_decoupled_lr_and_the_distributed_optimizer_is_bitwise_identical():
    """The lr schedule is a function of the iteration and the checkpoint's config: a run stopped
    at iteration 2 and resumed steps the embedding and output layer at the same lr as one that
    never stopped (every rank's master weights and moments compared bitwise)."""
    resume_is_bitwise(["--pipeline-schedule", "2bw", "--lr-decay-style", "linear",
                       "--lr-warmup-iters", "1", "--decoupled-lr", "1e-2", "--decoupled-min-lr",
                       "1e-3"], 1, 2)
