"""Initializing one tensor-parallel shard without materializing the full matrix.

`normal_shard(shape, std, dim, rank, size)` returns, bitwise, the rank-th of `size` chunks along
`dim` of the tensor `torch.empty(shape).normal_(0, std)` would draw from the default (CPU)
generator, and leaves the generator exactly where that full draw leaves it; so a layer built
with any tensor size holds the shard of the single-process layer built under the same seed, and
the layer's later draws do not move. It holds only the shard and one chunk-sized buffer.

How: the CPU generator's `normal_` on a float32 tensor of n >= 16 elements first draws n uniforms
(one 32-bit Mersenne-Twister output each), then Box-Muller-transforms them in blocks of 16 from
the start; when n % 16 != 0 it draws 16 more uniforms for the last 16 elements. The same stream
therefore comes out of consecutive `normal_` calls on pieces whose lengths are multiples of 16
(the last piece: at least 16 elements, any length). The full matrix is viewed as rows x width

    dim 0 (and any shard that is a row range):  rows = shape[0],      width = the rest
    dim d > 0:                                   rows = prod(shape[:d]), width = prod(shape[d:])

and streamed in groups of whole rows (a multiple of 16 elements, about `chunk` of them): a group
that holds part of the shard is generated with `normal_` and its part copied out; a group that
holds none is skipped by drawing as many uniforms (`uniform_` consumes the stream exactly like
`normal_`, for less work). Other dtypes, tiny tensors and other default devices (meta, under
`with torch.device(...)`) are drawn whole and sliced, as before.
"""
from __future__ import annotations

import math

import torch

STREAM_CHUNK = 1 << 20  # elements generated per step (4 MiB of fp32)
_BLOCK = 16             # the CPU normal_ kernel's Box-Muller block


def normal_shard(shape: tuple, std: float, dim: int, rank: int = 0, size: int = 1,
                 chunk: int = STREAM_CHUNK) -> torch.Tensor:
    """The rank-th of `size` equal chunks along `dim` of a normal(0, std) tensor of `shape` drawn
    from the default generator (see the module doc). shape[dim] must be divisible by size."""
    shape = tuple(int(s) for s in shape)
    if shape[dim] % size:
        raise ValueError(f"dimension {shape[dim]} is not divisible by the tensor-parallel size "
                         f"{size}")
    numel = math.prod(shape)
    if size == 1 or torch.get_default_dtype() != torch.float32 or numel < _BLOCK or \
            torch.empty(0).device.type != "cpu":  # another default device: its own generator
        full = torch.empty(shape).normal_(0.0, std)
        return full if size == 1 else full.chunk(size, dim=dim)[rank].clone()
    per = shape[dim] // size
    inner = math.prod(shape[dim + 1:])
    if dim == 0:
        rows, width = shape[0], inner
        row_lo, row_hi, col_lo, col_hi = rank * per, (rank + 1) * per, 0, width
    else:
        rows, width = math.prod(shape[:dim]), shape[dim] * inner
        row_lo, row_hi, col_lo, col_hi = 0, rows, rank * per * inner, (rank + 1) * per * inner
    local = list(shape)
    local[dim] = per
    out = torch.empty(local)
    _stream(out.view(row_hi - row_lo, col_hi - col_lo), rows, width, (row_lo, row_hi),
            (col_lo, col_hi), std, chunk)
    return out


def _row_groups(rows: int, width: int, chunk: int) -> list[tuple[int, int]]:
    """[(first row, end row)]: every group but the last is a multiple of 16 elements; the last
    holds at least 16 (the caller ensures rows * width >= 16)."""
    unit = _BLOCK // math.gcd(width, _BLOCK)
    step = max(unit, (chunk // width) // unit * unit)
    bounds = list(range(0, rows, step)) + [rows]
    if len(bounds) > 2 and (bounds[-1] - bounds[-2]) * width < _BLOCK:
        del bounds[-2]  # a last piece under 16 elements joins the one before
    return list(zip(bounds[:-1], bounds[1:]))


def _stream(out: torch.Tensor, rows: int, width: int, row_range: tuple, col_range: tuple,
            std: float, chunk: int) -> None:
    (r0, r1), (c0, c1) = row_range, col_range
    groups = _row_groups(rows, width, chunk)
    buf = torch.empty(max(hi - lo for lo, hi in groups) * width + _BLOCK)
    for lo, hi in groups:
        n = (hi - lo) * width
        if hi <= r0 or lo >= r1:  # nothing of the shard here: consume the stream only
            tail = _BLOCK if hi == rows and n % _BLOCK else 0
            buf[:n + tail].uniform_()
            continue
        values = buf[:n].normal_(0.0, std).view(hi - lo, width)
        a, b = max(lo, r0), min(hi, r1)
        out[a - r0:b - r0].copy_(values[a - lo:b - lo, c0:c1])
