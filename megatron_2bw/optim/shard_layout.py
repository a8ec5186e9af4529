"""How `--use-distributed-optimizer` cuts a stage's flat buffers across its w data-parallel ranks.

Pure arithmetic (unit-tested without processes); `weights.py` lays the flat buffers out with the
padding this asks for, `batch_step.py` runs the collectives over the pieces, and
`optim/distributed.py` steps them.

Regions. The flat layout (weights.py) is cut into regions, each padded with zeros to a multiple
of w so that it splits into w equal pieces:

    [ tied | pad ][ bucket 1 | pad ] ... [ bucket k | pad ]   a stage holding one copy of a
                                                cross-stage tied weight (first or last stage, d > 1)
    [ bucket 1 | pad ] ... [ bucket k | pad ]   every other stage

A bucket is at most `bucket` elements (`--ddp-bucket-size`; `bucket_elements`: Megatron's
default, max(40M, 1M * w)), cut in layout order: the unit of the data-parallel reduction
(pipeline/grad_reduce.py), which starts as soon as the batch's last backward has produced it. An
unsharded layout (w = 1 pieces) has the same regions without padding.

The tied region is separate because its gradient is summed by the tied all-reduce (first and last
stage of every replica), not by the data-parallel reduce-scatter, and both stages must cut it at
the same offsets (their other regions have different lengths). Rank r of the data-parallel group
owns piece r of every region: at most two contiguous ranges of the flat buffer, its *shard*.

Coordinates. `lo, hi` of a piece are offsets in the padded flat buffer. The *global* offsets of
a piece are those of the same elements in the unpadded concatenation of the stage's parameters
(the layout checkpoints store, `VersionedWeights.pack`): global = padded - (padding before the
region); a piece's real elements end where its region's parameters end (`real_hi`). Checkpoints
name optimizer shards by these global ranges, so any w (or no sharding) can load them.
"""
from __future__ import annotations

from dataclasses import dataclass


def round_up(n: int, k: int) -> int:
    return -(-n // k) * k


@dataclass(frozen=True)
class Region:
    lo: int        # padded offset where the region starts
    real_hi: int   # padded offset where its parameters end
    hi: int        # padded offset where its padding ends
    shift: int     # padding before the region: global offset = padded offset - shift


@dataclass(frozen=True)
class Piece:
    lo: int        # padded offsets of rank r's part of a region
    hi: int
    real: int      # elements of it that are parameters (the rest is padding)
    global_lo: int  # offset of its first element in the unpadded layout

    @property
    def size(self) -> int:
        return self.hi - self.lo

    @property
    def global_range(self) -> tuple[int, int]:
        return self.global_lo, self.global_lo + self.real


class ShardLayout:
    """Regions of a flat buffer of `lengths` (real elements per region) cut into `count` pieces
    each; `count` 1 is the unsharded layout (one piece per region, no padding)."""

    def __init__(self, lengths: list[int], count: int):
        if count < 1:
            raise ValueError(f"a shard layout needs at least one rank, got {count}")
        self.count = count
        regions, lo, shift = [], 0, 0
        for n in lengths:
            hi = lo + round_up(n, count)
            regions.append(Region(lo, lo + n, hi, shift))
            shift += hi - lo - n
            lo = hi
        self.regions = tuple(regions)
        self.numel = lo                      # padded length
        self.real_numel = lo - shift         # parameters

    def pieces(self, rank: int) -> list[Piece]:
        """Rank `rank`'s piece of every region (its shard), in buffer order."""
        if not 0 <= rank < self.count:
            raise ValueError(f"shard rank {rank} outside 0..{self.count - 1}")
        out = []
        for g in self.regions:
            size = (g.hi - g.lo) // self.count
            lo = g.lo + rank * size
            real = max(0, min(lo + size, g.real_hi) - lo)
            out.append(Piece(lo, lo + size, real, lo - g.shift))
        return out

    def shard_numel(self) -> int:
        """Elements of one rank's shard (padding included): numel / count."""
        return self.numel // self.count

    def padded_offset(self, global_offset: int) -> int:
        """Where element `global_offset` of the unpadded layout sits in the padded buffer."""
        for g in self.regions:
            if global_offset < g.real_hi - g.shift:
                return global_offset + g.shift
        raise IndexError(f"offset {global_offset} outside {self.real_numel} parameters")

    def real_ranges(self) -> list[tuple[int, int]]:
        """Padded (lo, hi) of every region's parameters (what `pack` keeps)."""
        return [(g.lo, g.real_hi) for g in self.regions]


def bucket_elements(size: int | None, width: int) -> int:
    """Elements per data-parallel reduction bucket: `size` (--ddp-bucket-size), or Megatron's
    default for `width` data-parallel ranks, max(40M, 1M * w) (larger groups need larger buckets
    to stay bandwidth-bound)."""
    if size is None:
        return max(40_000_000, 1_000_000 * width)
    if size < 1:
        raise ValueError(f"--ddp-bucket-size must be a positive number of elements, got {size}")
    return size


def region_lengths(sizes: list[int], tied: int, bucket: int | None) -> list[int]:
    """Real elements per region of a stage whose parameters have `sizes` (layout order), the
    first `tied` of them (a count of parameters) forming a separate tied region (0: none); the
    rest cut into buckets of whole parameters, at most `bucket` elements each unless one
    parameter is larger (it is then a bucket alone); None: one bucket."""
    cuts: list[int] = []
    for n in sizes[tied:]:
        if cuts and (not bucket or cuts[-1] + n <= bucket):
            cuts[-1] += n
        else:
            cuts.append(n)
    return ([sum(sizes[:tied])] if tied else []) + (cuts or [0])


def _even_lengths(params: int, tied: int, bucket: int | None) -> list[int]:
    rest = params - tied
    k = max(1, -(-rest // bucket)) if bucket else 1
    return ([tied] if tied else []) + [rest // k + (i < rest % k) for i in range(k)]


def padded_numel(params: int, tied: int, count: int, bucket: int | None = None) -> int:
    """Length of the padded flat buffer of a stage with `params` parameters of which `tied` form
    a separate tied region (0: none), sharded `count` ways (the memory model's count). The rest
    is one region when it fits in one `bucket` (exact); otherwise the model does not know the
    parameters' sizes and cuts it into equal buckets: within count - 1 elements per bucket of
    the engine's `region_lengths`."""
    return ShardLayout(_even_lengths(params, tied, bucket), count).numel


__all__ = ["ShardLayout", "Region", "Piece", "bucket_elements", "padded_numel",
           "region_lengths", "round_up"]
