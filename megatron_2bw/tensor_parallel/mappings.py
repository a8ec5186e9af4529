"""Autograd-aware moves in and out of the tensor-parallel region (Megatron's four mappings).

    copy_to_tp_region      forward: identity          backward: all-reduce
    reduce_from_tp_region  forward: all-reduce        backward: identity
    scatter_to_tp_region   forward: keep my last-dim chunk   backward: all-gather
    gather_from_tp_region  forward: all-gather last dim      backward: keep my chunk

The group travels as a `TPGroup` value (no module-level state), with the Comm its collectives go
through (parallel/comm.py). With size 1 every mapping is the identity, so the same layer code is
the single-process reference.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..parallel.comm import Comm


@dataclass(frozen=True)
class TPGroup:
    group: Any = None   # torch.distributed group, None when size == 1
    rank: int = 0
    size: int = 1
    comm: Any = None    # Comm; the process group's when not given

    def __post_init__(self):
        if self.comm is None and self.size > 1:
            object.__setattr__(self, "comm", Comm())

    def __deepcopy__(self, memo) -> "TPGroup":
        return self  # a handle to a process group: weight-version replicas share it

    @classmethod
    def from_grid(cls, grid) -> "TPGroup":
        return cls(grid.group("tp"), grid.tp_rank, grid.tensor, grid.comm)


def _all_reduce(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    if tp.size == 1:
        return x
    x = x.contiguous().clone()
    tp.comm.all_reduce(x, tp.group)
    return x


def _split_last(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    if tp.size == 1:
        return x
    return x.chunk(tp.size, dim=-1)[tp.rank].contiguous()


def _gather_last(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    if tp.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    tp.comm.all_gather(parts, x, tp.group)
    return torch.cat(parts, dim=-1)


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.tp), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        return _all_reduce(x, tp)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _split_last(x, tp)

    @staticmethod
    def backward(ctx, g):
        return _gather_last(g, ctx.tp), None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _gather_last(x, tp)

    @staticmethod
    def backward(ctx, g):
        return _split_last(g, ctx.tp), None


def copy_to_tp_region(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return x if tp.size == 1 else _Copy.apply(x, tp)


def reduce_from_tp_region(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return x if tp.size == 1 else _Reduce.apply(x, tp)


def scatter_to_tp_region(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return x if tp.size == 1 else _Scatter.apply(x, tp)


def gather_from_tp_region(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return x if tp.size == 1 else _Gather.apply(x, tp)
