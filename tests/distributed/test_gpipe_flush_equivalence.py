"""GPipe in flushes (`--gpipe-microbatches-per-flush k`) on gloo processes: a batch run as
flushes of at most k microbatches (the last one shorter when k does not divide m) equals the
single-process reference (fp32, rtol 1e-5: the same numbers as GPipe, one step per batch) with
data parallelism and gradient buckets started in the last backward, and no stage ever holds more
than k microbatches' activations."""
import pytest

from megatron_2bw.pipeline.engine import PipelineEngine
from megatron_2bw.schedule.kinds import schedule_kind
from megatron_2bw.schedule.tables import make_schedule
from megatron_2bw.testing.verify import parse, run

TINY = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --lr 3e-3 --train-iters 3 --clip-grad 0.3 "
        "--timeout-minutes 1 --ddp-bucket-size 3000").split()


class AtMostKInFlight(PipelineEngine):
    """Fails the run if a stage ever stashes more than k microbatches."""

    def _forward(self, a):
        super()._forward(a)
        assert len(self.outputs) <= self.kind.microbatches_per_flush, len(self.outputs)


class OneFlushAnyway(AtMostKInFlight):
    """Broken: runs GPipe's one-flush table whatever k says."""

    def start(self, num_batches=None):
        super().start(num_batches)
        self.schedule = make_schedule(schedule_kind("gpipe"), self.num_stages, self.m,
                                      num_batches=self.schedule.num_batches,
                                      first_batch=self.iteration)
        self._plan_receives(self.schedule)


def check(k, d=2, w=2, m=5, t=1, *extra, engine_class=AtMostKInFlight):
    cfg, _ = parse(["--schedule", "gpipe", "--gpipe-microbatches-per-flush", str(k),
                    "--pipeline-model-parallel-size", str(d), "--data-parallel-size", str(w),
                    "--tensor-model-parallel-size", str(t),
                    "--global-batch-size", str(2 * m * w)] + TINY + list(extra))
    assert cfg.microbatches_per_flush == k
    rep = run(cfg, timeout_minutes=1, engine_class=engine_class)
    assert rep.passed(1e-5), rep
    assert rep.tied_equal and rep.replicas_equal and not rep.problems


def test_flushes_of_two_with_a_remainder_match_the_reference():
    check(2)  # d=2, w=2, m=5: flushes of 2, 2 and 1


def test_the_in_flight_check_catches_an_engine_that_runs_one_flush():
    with pytest.raises(Exception, match="AssertionError|process"):
        check(2, 2, 1, 4, engine_class=OneFlushAnyway)


@pytest.mark.slow
@pytest.mark.parametrize("k,d,w,m,t,extra", [
    (1, 4, 1, 4, 1, ()),
    (3, 2, 2, 6, 1, ("--use-distributed-optimizer",)),
    (2, 2, 1, 4, 2, ("--sequence-parallel", "--init-method-std", "0.1")),
])
def test_more_layouts_match_the_reference(k, d, w, m, t, extra):
    check(k, d, w, m, t, *extra)
