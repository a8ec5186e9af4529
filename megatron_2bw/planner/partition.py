"""Contiguous partition of a layer list into pipeline stages minimizing the slowest stage.

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

import numpy as np

from .topology import PlanError

_EPS = 1e-12


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


def bottleneck(costs, num_stages: int) -> float:
    """The smallest achievable maximum stage sum."""
    n = len(costs)
    _check(n, num_stages)
    if any(c < 0 for c in costs):
        raise PlanError("layer costs must be >= 0")
    p = np.asarray(_prefix(costs))
    sums = np.unique((p[None, :] - p[:, None])[np.triu_indices(n + 1, 1)])
    sums = sums[sums >= max(costs) - _EPS * max(max(costs), 1.0)]
    prefix = list(p)
    lo, hi = 0, len(sums) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _stages_needed(prefix, float(sums[mid])) <= num_stages:
            hi = mid
        else:
            lo = mid + 1
    return float(sums[lo])


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


def stage_sums(costs, bounds: list[int]) -> list[float]:
    return [float(sum(costs[bounds[s]:bounds[s + 1]])) for s in range(len(bounds) - 1)]


def _check(n: int, d: int) -> None:
    if not isinstance(d, int) or d < 1:
        raise PlanError(f"the number of pipeline stages must be an integer >= 1, got {d!r}")
    if d > n:
        raise PlanError(f"cannot split {n} layers into {d} non-empty stages: use at most {n} "
                        "pipeline stages")


__all__ = ["partition", "bottleneck", "stage_sums"]
