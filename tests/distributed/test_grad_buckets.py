"""Issue 32, Build point 1 on gloo processes: the data-parallel reduction in buckets that start
during the batch's last backward (pipeline/grad_reduce.py). With buckets small enough that a
stage has several, every schedule and gradient-buffer mode, the distributed optimizer, tensor and
sequence parallelism still equal the single-process reference (fp32, rtol 1e-5), buckets really
start inside the backward, a bucket started before its gradient is complete is caught, and at
w=2 the run is bitwise the one that starts every bucket at R (--no-overlap-grad-reduce)."""
import os
import tempfile

import pytest
import torch

from megatron_2bw.pipeline.engine import PipelineEngine
from megatron_2bw.testing.verify import _worker, parse, run
from megatron_2bw.training.spawn import spawn

TINY = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --lr 3e-3 --train-iters 4 --clip-grad 0.3 "
        "--timeout-minutes 1").split()
BUCKETS = ["--ddp-bucket-size", "3000"]  # a 4-layer hidden-32 stage: 4-6 buckets
SLOW = pytest.mark.slow


def flags(schedule, d=2, w=2, *extra, m=4, t=1):
    return (["--schedule", schedule, "--pipeline-model-parallel-size", str(d),
             "--tensor-model-parallel-size", str(t), "--data-parallel-size", str(w),
             "--global-batch-size", str(2 * m * w)] + TINY + BUCKETS + list(extra))


class EarlyBucketEngine(PipelineEngine):
    """The engine, checking that every stage has several buckets and that all but the ones R
    must start (the tail's, sequence-parallel ones) started inside the last backward."""

    def _step(self, a):
        r = self.stepper.reduction
        assert len(r.buckets) >= 3, len(r.buckets)
        assert r.early_buckets >= (a.batch + 1 - self.schedule.first_batch), r.early_buckets
        super()._step(a)


class ArmsOnTheFirstBackward(PipelineEngine):
    """Broken: the hooks are armed on the batch's first backward, so buckets are reduced before
    the other microbatches added their gradients."""

    def _backward(self, a):
        r = self.stepper.reduction
        if a.mb % self.m == 0 and r.overlap:
            r.arm(a.mb // self.m, a.version)
            r._backwards[a.mb // self.m] = -self.m  # the real last backward does not arm again
        super()._backward(a)


@pytest.mark.parametrize("schedule,extra,d,w,t", [
    pytest.param("2bw", (), 2, 2, 1, id="2bw-d2w2"),
    pytest.param("flush", (), 2, 2, 1, id="flush-d2w2"),
    pytest.param("gpipe", (), 2, 2, 1, id="gpipe-d2w2", marks=SLOW),
    pytest.param("2bw", ("--2bw-grad-buffers", "1"), 2, 2, 1, id="2bw-g1-d2w2"),
    pytest.param("2bw", ("--2bw-grad-buffers", "first"), 2, 2, 1, id="2bw-gfirst-d2w2",
                 marks=SLOW),
    pytest.param("2bw", ("--use-distributed-optimizer",), 2, 2, 1, id="2bw-d2w2-distopt"),
    pytest.param("flush", ("--use-distributed-optimizer",), 2, 2, 1, id="flush-d2w2-distopt",
                 marks=SLOW),
    pytest.param("2bw", ("--2bw-compensation", "predict", "--use-distributed-optimizer"), 2, 2,
                 1, id="2bw-predict-d2w2-distopt", marks=SLOW),
    pytest.param("2bw", ("--sequence-parallel", "--lr", "1e-4"), 1, 2, 2, id="2bw-t2w2-sp"),
    pytest.param("2bw", ("--lr", "1e-4"), 1, 3, 1, id="2bw-d1w3", marks=SLOW)])
def test_buckets_started_in_the_last_backward_match_the_reference(schedule, extra, d, w, t):
    cfg, _ = parse(flags(schedule, d, w, *extra, t=t))
    assert cfg.parallel.grad_bucket_size == 3000 and cfg.parallel.overlap_grad_reduce
    rep = run(cfg, timeout_minutes=1, engine_class=EarlyBucketEngine)
    assert rep.passed(1e-5), rep
    assert rep.tied_equal and rep.replicas_equal


def test_the_checker_catches_buckets_reduced_before_their_gradient_is_complete():
    cfg, _ = parse(flags("flush"))
    rep = run(cfg, timeout_minutes=1, engine_class=ArmsOnTheFirstBackward)
    assert not rep.passed(1e-5) and rep.max_rel_diff > 1e-3, rep


def _results(cfg):
    world = cfg.parallel.tensor * cfg.parallel.pipeline * cfg.data_parallel_size
    with tempfile.TemporaryDirectory() as out:
        spawn(_worker, world, args=(cfg, out, PipelineEngine, 0), timeout_minutes=1)
        return [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(world)]


@pytest.mark.parametrize("schedule,extra", [
    pytest.param("2bw", (), id="2bw"),
    pytest.param("flush", ("--use-distributed-optimizer",), id="flush-distopt")])
def test_early_buckets_are_bitwise_the_reduction_at_r(schedule, extra):
    early = _results(parse(flags(schedule, 2, 2, *extra))[0])
    at_r = _results(parse(flags(schedule, 2, 2, *extra, "--no-overlap-grad-reduce"))[0])
    for a, b in zip(early, at_r):
        assert a["losses"] == b["losses"] and a["grad_norms"] == b["grad_norms"]
        assert a["params"].keys() == b["params"].keys()
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
