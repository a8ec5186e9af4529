"""The planner's timing: replay the engine's own schedule tables through `schedule.simulate`.

The time per batch of a layout is the steady-state increment the simulator reports: the makespan
of a b-batch segment minus that of an a-batch one, (a, b) = the schedule kind's `segments`, with
the cost model's durations (F, B, R, N, S per stage) and per-op p2p transfer times. 2BW compares 4
with 3 batches (past its one warm-up); GPipe and flush drain the pipeline at every step, so every
batch is the same and 2 minus 1 batches gives the identical number with fewer events. Two
refinements keep the search fast and honest:

- many microbatches: with m > M = max(2d, 8) the simulator runs m' = M and M - M/2 microbatches
  and the increment is extended linearly in m (pipelines are affine in m once the bottleneck stage
  dominates; `full=True` simulates the real m instead); GPipe in flushes of k microbatches is
  composed from one-flush GPipe increments (`_in_flushes`: its flushes run one after another);
- the result is never below `StagePlan.lower_bound()` (what the busiest stage alone needs), which
  also corrects a 2BW warm-up transient that can outlast three batches when stages are uneven.

`Estimate.source` says which applied: "simulated", "extrapolated" or "bound".
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from megatron_2bw.planner.cost_model import StagePlan
from megatron_2bw.planner.topology import GB
from megatron_2bw.schedule.simulate import SimResult, simulate
from megatron_2bw.schedule.tables import make_schedule


@dataclass
class Estimate:
    plan: StagePlan
    time_per_batch: float
    lower_bound: float
    source: str

    @property
    def layout(self):
        return self.plan.layout

    @property
    def samples_per_s(self) -> float:
        return self.layout.global_batch / self.time_per_batch if self.time_per_batch > 0 else 0.0

    @property
    def bubble(self) -> float:
        """Idle fraction of the steady state, averaged over stages."""
        d = self.layout.pipeline
        busy = sum(self.plan.busy(s) for s in range(d)) / d
        return max(0.0, 1.0 - busy / self.time_per_batch) if self.time_per_batch > 0 else 0.0

    @property
    def memory_gb(self) -> list:
        return [m["total"] / GB for m in self.plan.memory]

    def to_dict(self) -> dict:
        L = self.layout
        return {"schedule": L.schedule, "tensor": L.tensor, "pipeline": L.pipeline,
                "data": L.data, "micro_batch_size": L.micro_batch,
                "num_microbatches": L.num_microbatches, "global_batch_size": L.global_batch,
                "recompute": L.recompute, "recompute_granularity": L.recompute_name,
                "distributed_optimizer": L.distributed_optimizer,
                "sequence_parallel": L.sequence_parallel, "rank_order": L.rank_order,
                "grad_buffers": L.kind.grad_buffers,
                "microbatches_per_flush": L.kind.microbatches_per_flush,
                "partition": self.plan.bounds, "time_per_batch_s": self.time_per_batch,
                "samples_per_s": self.samples_per_s, "bubble": self.bubble,
                "memory_gb_per_stage": [round(x, 4) for x in self.memory_gb],
                "peak_in_flight": self.plan.peak_in_flight, "source": self.source}


_SCHEDULES: dict = {}  # (kind, d, m, batches) -> Schedule: its table is generated once


def _schedule(kind, d: int, m: int, num_batches: int):
    """`kind`: a name or a ScheduleKind (a one-buffer 2BW has its own table)."""
    key = (kind, d, m, num_batches)
    if key not in _SCHEDULES:
        if len(_SCHEDULES) > 256:
            _SCHEDULES.clear()
        _SCHEDULES[key] = make_schedule(kind, d, m, num_batches)
    return _SCHEDULES[key]


def run_segment(plan: StagePlan, num_batches: int, m: int | None = None) -> SimResult:
    """Simulate `num_batches` batches of the layout's schedule with its durations."""
    L = plan.layout
    dur, comm = plan.durations()
    sched = _schedule(L.kind, L.pipeline, m or L.num_microbatches, num_batches)
    return simulate(sched, dur, comm)


def steady_increment(plan: StagePlan, m: int | None = None) -> float:
    a, b = (run_segment(plan, T, m).makespan for T in plan.layout.kind.segments)
    return b - a


def _increment(plan: StagePlan, m: int, full: bool) -> tuple[float, bool]:
    """(steady increment of the layout's schedule at m microbatches, extrapolated?): past
    M = max(2d, 8) microbatches from M and M - M/2 (unless `full`)."""
    cap = max(2 * plan.layout.pipeline, 8)
    if full or m <= cap:
        return steady_increment(plan, m), False
    k = cap // 2
    hi, lo = steady_increment(plan, cap), steady_increment(plan, cap - k)
    return hi + (m - cap) * (hi - lo) / k, True


def _in_flushes(plan: StagePlan) -> tuple[float, bool]:
    """GPipe in flushes of k: the flushes run strictly one after another (a flush ends with
    stage 0's backward of its first microbatch, after every other stage's last action of it,
    and the next starts with stage 0's forward), so a batch of n full flushes and a remainder
    of r lasts n T(k) + T(r) + tail, where T(x) + tail is one-flush GPipe's increment at x
    microbatches (extrapolated as GPipe's) and tail (R N S and the wait for them) is
    2 (T(1) + tail) - (2 T(1) + tail), from two one-microbatch runs."""
    L = plan.layout
    k = L.microbatches_per_flush
    n, r = divmod(L.num_microbatches, k)
    one = replace(plan, layout=replace(L, microbatches_per_flush=None))  # a single flush
    ones = replace(plan, layout=replace(L, microbatches_per_flush=1))
    tail = 2 * steady_increment(one, 1) - steady_increment(ones, 2)
    t, extrapolated = _increment(one, k, False)
    t = n * (t - tail) + tail
    if r:
        tr, more = _increment(one, r, False)
        t, extrapolated = t + tr - tail, extrapolated or more
    return t, extrapolated


def predict(plan: StagePlan, full: bool = False) -> Estimate:
    L = plan.layout
    bound = plan.lower_bound()
    if L.microbatches_per_flush and L.microbatches_per_flush < L.num_microbatches and not full:
        t, extrapolated = _in_flushes(plan)
    else:
        t, extrapolated = _increment(plan, L.num_microbatches, full)
    source = "extrapolated" if extrapolated else "simulated"
    if t < bound:
        source = "bound" if bound - t > 1e-9 * bound else source  # not for rounding noise
        t = bound
    return Estimate(plan, t, bound, source)


__all__ = ["Estimate", "predict", "run_segment", "steady_increment"]
