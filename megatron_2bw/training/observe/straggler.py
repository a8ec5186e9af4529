"""--log-straggler: which rank slows the run, from the engine's own action timers.

At each log interval every rank sums its timers (pipeline/timers.py, read once per interval:
CUDA events on a GPU, nothing waits for them before) into milliseconds per iteration of

    compute   forward + backward + optimizer     what the rank itself works
    wait      p2p + all-reduce                   what it spends blocked on its peers

and one all-gather (`Comm.gather_floats`, at the log interval only) gives every rank the table.
The log line gets each stage's compute and wait (the maximum over the stage's tensor and
data-parallel ranks), the slowest rank and how far its compute lies above the median of its
peers; when that is more than --straggler-threshold percent, a line of its own names the rank and
its stage. The first interval of a run (pipeline fill, allocator growth) names nobody.

Peers: with data parallelism (w > 1) the ranks of the same stage, which do the same work, so an
unbalanced partition is not mistaken for a straggler (with tensor parallelism the slow rank's
whole tensor group computes slowly, since it waits inside the layers' all-reduces: the group is
the straggler, the named rank one of it). With one replica every rank is a peer and stages are
compared with each other: a stage of higher cost (embedding and loss on the ends) counts as a
straggler, so set the threshold above that spread (the first log lines show it). The median is the
lower median (with two peers: the faster), so a single slow rank among few stands out. A slow
rank makes its neighbours wait, not compute: their wait grows, which the line shows too.
"""
from __future__ import annotations

from collections.abc import Mapping
from statistics import median_low


COMPUTE = ("forward", "backward", "optimizer")
WAIT = ("p2p", "all-reduce")


def rank_times(timers: Mapping[str, float], iterations: int) -> list[float]:
    """[compute ms, wait ms] per iteration of this rank from the engine's timer totals (s)."""
    n = max(iterations, 1)
    return [1e3 * sum(timers.get(k, 0.0) for k in keys) / n for keys in (COMPUTE, WAIT)]


def straggler_report(rows: list[list[float]], grid, threshold: float, iteration: int,
                     name: bool = True) -> tuple[dict, str | None]:
    """(log fields, the line naming the straggler or None) of every rank's [compute, wait]
    (`rows`, in rank order); `name=False` (the first interval) never names one."""
    stage_of = [grid.coords(r)[1] for r in range(len(rows))]
    compute, wait = [0.0] * grid.pipeline, [0.0] * grid.pipeline
    for r, (c, w) in enumerate(rows):
        compute[stage_of[r]] = max(compute[stage_of[r]], c)
        wait[stage_of[r]] = max(wait[stage_of[r]], w)
    medians = {s: median_low(rows[r][0] for r in range(len(rows))
                             if grid.data == 1 or stage_of[r] == s) for s in set(stage_of)}

    def above(r: int) -> float:
        middle = medians[stage_of[r]]
        return 100.0 * (rows[r][0] / middle - 1.0) if middle > 0 else 0.0
    slowest = max(range(len(rows)), key=above)
    fields = {"compute ms per stage": compute, "wait ms per stage": wait,
              "slowest rank": slowest, "slowest % above median": above(slowest)}
    if not name or above(slowest) <= threshold:
        return fields, None
    peers = "its stage's ranks" if grid.data > 1 else "all ranks"
    return fields, (f"straggler at iteration {iteration}: {grid.describe(slowest)} computes "
                    f"{rows[slowest][0]:.1f} ms per iteration, {above(slowest):.0f}% above the "
                    f"median of {peers} ({medians[stage_of[slowest]]:.1f} ms; "
                    f"--straggler-threshold {threshold:g}%); it waits {rows[slowest][1]:.1f} ms")
