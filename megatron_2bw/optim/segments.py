"""Where a flat optimizer's arithmetic changes along its layout (optim/optimizer.py): the weight
decay ([0, decay_end) decays, pipeline/weights.py puts the decayed parameters first) and the lr
class (1 inside the decoupled ranges: the embedding and output parameters under --decoupled-lr,
optim/lr.py; 0 elsewhere). Pure arithmetic on offsets, computed once per optimizer: a step runs
one kernel call per segment, never one per parameter."""
from __future__ import annotations


def segments(numel: int, decay_end: int, weight_decay: float, decoupled=()
             ) -> list[tuple[int, int, float, int]]:
    """The layout cut where the weight decay or the lr class changes: (lo, hi, weight decay, lr
    class), class 1 inside the `decoupled` ranges. Without any: [0, decay_end) with the weight
    decay and the rest without (one segment when the weight decay is 0)."""
    cut = min(decay_end, numel) if weight_decay else 0
    inside = [(max(0, lo), min(hi, numel)) for lo, hi in decoupled if min(hi, numel) > max(0, lo)]
    points = sorted({0, numel, cut, *(x for r in inside for x in r)})
    out: list[tuple[int, int, float, int]] = []
    for lo, hi in zip(points, points[1:]):
        wd = weight_decay if lo < cut else 0.0
        k = int(any(a <= lo < b for a, b in inside))
        if out and out[-1][2:] == (wd, k):
            out[-1] = (out[-1][0], hi, wd, k)
        else:
            out.append((lo, hi, wd, k))
    return out


def lr_runs(segs) -> list[tuple[int, int, int]]:
    """The segments merged where only the weight decay changes: (lo, hi, lr class)."""
    out: list[tuple[int, int, int]] = []
    for lo, hi, _wd, k in segs:
        if out and out[-1][2] == k:
            out[-1] = (out[-1][0], hi, k)
        else:
            out.append((lo, hi, k))
    return out


def within(runs, lo: int, hi: int):
    """The parts of `runs` (lo, hi, ...) inside [lo, hi), with their other fields."""
    for a, b, *rest in runs:
        a, b = max(a, lo), min(b, hi)
        if b > a:
            yield (a, b, *rest)
