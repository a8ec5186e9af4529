"""The one partitioner: where a layer list is cut into pipeline stages.

- `split_evenly(n, d)`: layers as evenly as possible (the default for the model families).
- `partition_uniform` / `partition_balanced`: DeepSpeed's `uniform` and linear-partition
  arithmetic (same stages for the same layer list; deepspeed/pipe/partition.py picks them).
- `partition(costs, d)` / `partition_minmax`: the contiguous split minimizing the slowest stage
  (the planner's, and DeepSpeed's `profile` method).
- `partition_within(costs, d, fits)`: the same among the splits whose every stage `fits` (the
  planner's, when the time-balanced split puts more on a stage than its memory holds).

About `partition`:

Layers are the model's spec list (embedding, transformer blocks, head) with their real per-layer
costs, so the embedding and the output layer weigh what they cost instead of being ignored (a
uniform split of the blocks overloads the first and last stage).

`partition(costs, d)` returns spec-index boundaries `[0, e1, ..., len(costs)]`: stage s runs
layers [bounds[s], bounds[s+1]); every layer is placed exactly once and every stage is non-empty.
The optimum bottleneck is one of the O(n^2) contiguous-range sums; a binary search over them with a
greedy feasibility test finds the smallest feasible one. Among optimal partitions it prefers the
one that packs later stages fuller (earlier stages hold more in-flight microbatches).
"""
from __future__ import annotations

from bisect import bisect_left, bisect_right
from functools import lru_cache
from itertools import repeat
from operator import sub

from megatron_2bw.config import ConfigError

_EPS = 1e-12


class PartitionError(ConfigError):
    """A layer list that cannot be cut as asked (one line: what and the fix)."""


def _prefix(costs) -> list:
    out = [0.0]
    for c in costs:
        out.append(out[-1] + float(c))
    return out


def _stages_needed(prefix: list, limit: float) -> int:
    """Greedy from the left: fewest stages with every stage sum <= limit (n+1 if impossible)."""
    n, i, count = len(prefix) - 1, 0, 0
    slack = limit + _EPS * max(abs(limit), 1.0)
    while i < n:
        j = bisect_right(prefix, prefix[i] + slack) - 1
        if j <= i:
            return n + 1
        i, count = j, count + 1
    return count


def _limits(prefix: list, costs) -> list:
    """The contiguous-range sums a slowest stage can take (>= the largest layer), ascending."""
    return _range_sums(tuple(prefix), max(costs) - _EPS * max(max(costs), 1.0))


@lru_cache(maxsize=1024)
def _range_sums(prefix: tuple, least: float) -> list:
    """(the planner asks it for the same layer costs under many memory limits)"""
    sums = set()
    for i, start in enumerate(prefix):
        sums.update(map(sub, prefix[i + 1:], repeat(start)))
    return sorted(x for x in sums if x >= least)


def _first(sums, lo: int, feasible) -> int:
    """The first index in sums[lo:] at which `feasible` (False then True) holds."""
    hi = len(sums) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if feasible(float(sums[mid])):
            hi = mid
        else:
            lo = mid + 1
    return lo


def bottleneck(costs, num_stages: int) -> float:
    """The smallest achievable maximum stage sum."""
    n = len(costs)
    _check(n, num_stages)
    if any(c < 0 for c in costs):
        raise PartitionError("layer costs must be >= 0")
    prefix = _prefix(costs)
    sums = _limits(prefix, costs)
    return float(sums[_first(sums, 0, lambda x: _stages_needed(prefix, x) <= num_stages)])


def partition(costs, num_stages: int) -> list[int]:
    """Boundaries of an optimal contiguous split of `costs` into `num_stages` non-empty stages."""
    limit = bottleneck(costs, num_stages)
    prefix = _prefix(costs)
    n = len(costs)
    slack = limit + _EPS * max(abs(limit), 1.0)
    # greedy from the right: the last stages take as many layers as fit
    cuts, j = [n], n
    while j > 0:
        i = bisect_left(prefix, prefix[j] - slack)
        i = max(i, 0)
        if i >= j:
            i = j - 1
        cuts.append(i)
        j = i
    bounds = cuts[::-1]
    # split stages (earliest first, largest layers count) until there are exactly num_stages
    while len(bounds) - 1 < num_stages:
        s = next(s for s in range(len(bounds) - 1) if bounds[s + 1] - bounds[s] >= 2)
        bounds.insert(s + 1, bounds[s] + 1)
    return bounds


def partition_within(costs, num_stages: int, fits) -> list[int] | None:
    """Boundaries of the contiguous split of `costs` into `num_stages` non-empty stages whose
    slowest stage is fastest among those where every stage s, layers [lo, hi), has
    `fits(s, lo, hi)` (None: none found). `fits` must hold for any part of a range it holds
    for, and at any later stage (memory: fewer layers hold less, and a later stage holds fewer
    microbatches in flight). Stages fill from the last, each taking the most layers its time
    limit and `fits` allow while leaving one per stage before it; by those two properties no
    split reaches further left at any stage, so the smallest limit at which the fill succeeds
    is the optimum (a binary search over the contiguous-range sums, as `bottleneck`). Where
    `fits` lacks them the answer still fits, but a fitting split may be missed."""
    n = len(costs)
    _check(n, num_stages)
    if any(c < 0 for c in costs):
        raise PartitionError("layer costs must be >= 0")
    prefix, seen = _prefix(costs), {}

    def ok(s: int, lo: int, hi: int) -> bool:
        key = (s, lo, hi)
        if key not in seen:
            seen[key] = bool(fits(s, lo, hi))
        return seen[key]

    def fill(limit: float) -> list[int] | None:
        slack = limit + _EPS * max(abs(limit), 1.0)
        cuts, j = [n], n
        for s in range(num_stages - 1, 0, -1):
            i = max(bisect_left(prefix, prefix[j] - slack), s)
            if i >= j:
                return None
            lo, hi = i, j - 1  # the smallest start in [i, j - 1] that fits (monotone)
            if not ok(s, hi, j):
                return None
            while lo < hi:
                mid = (lo + hi) // 2
                if ok(s, mid, j):
                    hi = mid
                else:
                    lo = mid + 1
            cuts.append(lo)
            j = lo
        if prefix[j] > slack or not ok(0, 0, j):
            return None
        return [0] + cuts[::-1]

    loose = fill(prefix[-1])
    if loose is None:  # none fits, however slow
        return None
    sums = _limits(prefix, costs)
    # no split is faster than the unconstrained best, and the loose split is one
    lo = _first(sums, 0, lambda x: _stages_needed(prefix, x) <= num_stages)
    ceiling = max(prefix[loose[s + 1]] - prefix[loose[s]] for s in range(num_stages))
    top = ceiling + _EPS * max(ceiling, 1.0)
    sums = [x for x in sums[lo:] if x <= top]
    if not sums:
        return loose
    first = fill(float(sums[0]))  # often a split as fast as the unconstrained one fits
    if first is not None or len(sums) == 1:
        return first or loose
    return fill(float(sums[_first(sums, 1, lambda x: fill(x) is not None)])) or loose


def stage_sums(costs, bounds: list[int]) -> list[float]:
    return [float(sum(costs[bounds[s]:bounds[s + 1]])) for s in range(len(bounds) - 1)]


def _check(n: int, d: int) -> None:
    if not isinstance(d, int) or d < 1:
        raise PartitionError(f"the number of pipeline stages must be an integer >= 1, got {d!r}")
    if d > n:
        raise PartitionError(f"cannot split {n} layers into {d} non-empty stages: use at most {n} "
                             "pipeline stages")


__all__ = ["partition", "partition_within", "bottleneck", "stage_sums"]


def split_evenly(num_layers: int, num_stages: int) -> list[int]:
    """Stage boundaries [0, ..., num_layers] splitting layers as evenly as possible (the first
    num_layers % num_stages stages get one more); every stage gets at least one layer.
    DeepSpeed's `pipe.partition_uniform` is this plus empty stages when layers run short."""
    if num_stages > num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages")
    base, extra = divmod(num_layers, num_stages)
    bounds = [0]
    for s in range(num_stages):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return bounds


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """DeepSpeed's uniform split: the engine's `split_evenly` (the first `num_items % num_parts`
    parts get one more item), and with fewer items than parts one item each, then empty parts."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    return split_evenly(num_items, num_parts)


def partition_balanced(weights, num_parts: int) -> list[int]:
    """DeepSpeed's linear partition (same result): the contiguous split into `num_parts` non-empty
    parts minimizing max(stage sum) - min(stage sum); ties go to the largest split point."""
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    import numpy as np  # here: the planner's import path stays without numpy
    inf = np.inf
    dp_max = np.full((n + 1, m + 1), inf)
    dp_min = np.full((n + 1, m + 1), inf)
    dp_cost = np.full((n + 1, m + 1), inf)
    position = np.zeros((n + 1, m + 1), dtype=int)
    prefix = np.zeros(n + 1)
    prefix[1:] = np.cumsum(np.asarray(weights, dtype=float))
    dp_max[0, 0] = 0
    dp_cost[0, 0] = 0
    for i in range(1, n + 1):
        seg = prefix[i] - prefix[:i]                       # sum of items k..i-1 for every k < i
        for j in range(1, min(i, m) + 1):
            max_sum = np.maximum(dp_max[:i, j - 1], seg)
            min_sum = np.minimum(dp_min[:i, j - 1], seg)
            cost = max_sum - min_sum
            best = cost.min()
            k = int(np.flatnonzero(cost == best)[-1]) if np.isfinite(best) else i - 1
            dp_cost[i, j], dp_max[i, j], dp_min[i, j] = cost[k], max_sum[k], min_sum[k]
            position[i, j] = k
    parts = [n]
    for j in reversed(range(1, m + 1)):
        parts.append(int(position[parts[-1], j]))
    return parts[::-1]


def partition_minmax(costs, num_parts: int) -> list[int]:
    """Contiguous partition minimizing the largest stage cost (`partition`, as plain ints)."""
    return [int(b) for b in partition([float(c) for c in costs], num_parts)]
