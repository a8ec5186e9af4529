"""Autograd-aware moves in and out of the tensor-parallel region (Megatron's four mappings).

    copy_to_tp_region      forward: identity          backward: all-reduce
    reduce_from_tp_region  forward: all-reduce        backward: identity
    scatter_to_tp_region   forward: keep my last-dim chunk   backward: all-gather
    gather_from_tp_region  forward: all-gather last dim      backward: keep my chunk

and Megatron's sequence-parallel ones (activations [b, s, h]; the sequence is dim 1, and under
--sequence-parallel each tensor rank holds the contiguous s/t chunk of its rank between the
tensor-parallel regions: norms, dropout, residuals, and what crosses pipeline stages):

    scatter_to_sequence_parallel_region         forward: keep my chunk   backward: all-gather
    gather_from_sequence_parallel_region        forward: all-gather      backward: keep my chunk
        (the region after it computes a complete gradient on every rank: replicated layers)
    reduce_scatter_to_sequence_parallel_region  forward: reduce-scatter  backward: all-gather
        (replaces reduce_from_tp_region after a row-parallel layer)
    gather_linear(x, weight, bias)              forward: all-gather, then x W^T + b, keeping
        only the chunk for the backward (which all-gathers it again); backward of the input:
        reduce-scatter (replaces copy_to_tp_region before a column-parallel layer)

The group travels as a `TPGroup` value (no module-level state), with the Comm its collectives go
through (parallel/comm.py) and whether the model runs sequence-parallel. With size 1 every
mapping is the identity, so the same layer code is the single-process reference.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatron_2bw.parallel.comm import Comm


@dataclass(frozen=True)
class TPGroup:
    group: Any = None   # torch.distributed group, None when size == 1
    rank: int = 0
    size: int = 1
    comm: Any = None    # Comm; the process group's when not given
    sequence_parallel: bool = False  # --sequence-parallel (only meaningful with size > 1)

    def __post_init__(self):
        if self.comm is None and self.size > 1:
            object.__setattr__(self, "comm", Comm())

    def __deepcopy__(self, memo) -> "TPGroup":
        return self  # a handle to a process group: weight-version replicas share it

    @classmethod
    def from_grid(cls, grid, sequence_parallel: bool = False) -> "TPGroup":
        return cls(grid.group("tp"), grid.tp_rank, grid.tensor, grid.comm,
                   sequence_parallel and grid.tensor > 1)

    @property
    def split_sequence(self) -> bool:
        """Activations between the tensor-parallel regions hold this rank's sequence chunk."""
        return self.sequence_parallel and self.size > 1


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


def _split_seq(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return x.chunk(tp.size, dim=1)[tp.rank].contiguous()


def _gather_seq(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """[b, s/t, h] on every rank -> [b, s, h] (chunks in rank order along dim 1)."""
    x = x.contiguous()
    out = torch.empty((tp.size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype,
                      device=x.device)
    tp.comm.all_gather_into(out, x, tp.group)
    out = out.view((tp.size,) + tuple(x.shape)).transpose(0, 1)
    return out.reshape((x.shape[0], tp.size * x.shape[1]) + tuple(x.shape[2:]))


def _reduce_scatter_seq(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """[b, s, h] partial sums on every rank -> this rank's chunk [b, s/t, h] of their sum."""
    b, s = x.shape[:2]
    rest = tuple(x.shape[2:])
    parts = x.reshape((b, tp.size, s // tp.size) + rest).transpose(0, 1).contiguous()
    out = torch.empty((b, s // tp.size) + rest, dtype=x.dtype, device=x.device)
    tp.comm.reduce_scatter(out, parts.view((tp.size * b, s // tp.size) + rest), tp.group)
    return out


def _mapping(name: str, forward, backward):
    """An autograd Function x -> forward(x, tp) whose gradient is backward(g, tp)."""
    def fwd(ctx, x, tp):
        ctx.tp = tp
        return forward(x, tp)

    def bwd(ctx, g):
        return backward(g, ctx.tp), None
    return type(name, (torch.autograd.Function,),
                {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})


def _identity(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return x


_Copy = _mapping("_Copy", _identity, _all_reduce)
_Reduce = _mapping("_Reduce", _all_reduce, _identity)
_Scatter = _mapping("_Scatter", _split_last, _gather_last)
_Gather = _mapping("_Gather", _gather_last, _split_last)
_ScatterSeq = _mapping("_ScatterSeq", _split_seq, _gather_seq)
_GatherSeq = _mapping("_GatherSeq", _gather_seq, _split_seq)
_ReduceScatterSeq = _mapping("_ReduceScatterSeq", _reduce_scatter_seq, _gather_seq)


class _GatherLinear(torch.autograd.Function):
    """all-gather(x) W^T + b that keeps only x's chunk for the backward (Megatron's
    sequence-parallel column-parallel linear)."""

    @staticmethod
    def forward(ctx, x, weight, bias, tp):
        ctx.tp, ctx.has_bias = tp, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(_gather_seq(x, tp), weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        full = _gather_seq(x, ctx.tp)
        g2 = g.reshape(-1, g.shape[-1])
        grad_w = g2.t().matmul(full.reshape(-1, full.shape[-1]))
        grad_b = g2.sum(0) if ctx.has_bias else None
        return _reduce_scatter_seq(g.matmul(weight), ctx.tp), grad_w, grad_b, None


def scatter_to_sequence_parallel_region(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return _ScatterSeq.apply(x, tp) if tp.split_sequence else x


def gather_from_sequence_parallel_region(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return _GatherSeq.apply(x, tp) if tp.split_sequence else x


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return _ReduceScatterSeq.apply(x, tp) if tp.split_sequence else x


def gather_linear(x: torch.Tensor, weight: torch.Tensor, bias, tp: TPGroup) -> torch.Tensor:
    """The input side of a column-parallel layer: x W^T + b on the whole sequence (under
    sequence parallelism x is this rank's chunk), with the input gradient reduced over the
    tensor ranks."""
    if tp.split_sequence:
        return _GatherLinear.apply(x, weight, bias, tp)
    return F.linear(copy_to_tp_region(x, tp), weight, bias)


def reduce_output(y: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """The output side of a row-parallel layer: the sum of the ranks' partial results (under
    sequence parallelism only this rank's chunk of it)."""
    if tp.split_sequence:
        return _ReduceScatterSeq.apply(y, tp)
    return reduce_from_tp_region(y, tp)


def copy_to_tp_region(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return x if tp.size == 1 else _Copy.apply(x, tp)


def reduce_from_tp_region(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return x if tp.size == 1 else _Reduce.apply(x, tp)


def scatter_to_tp_region(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return x if tp.size == 1 else _Scatter.apply(x, tp)


def gather_from_tp_region(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return x if tp.size == 1 else _Gather.apply(x, tp)
