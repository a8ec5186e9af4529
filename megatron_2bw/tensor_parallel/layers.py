"""Column/row-parallel linear layers and the vocab-parallel embedding.

Weights are initialized as this rank's shard of the full (t=1) matrix drawn from the current RNG,
without materializing the full matrix (initialize.py), so a layer built with any tensor size holds
exactly the shard of the single-process layer built under the same seed. Sharded parameters carry
`tensor_model_parallel = True` and `partition_dim` (the flat weight layout, the grad-norm and the
equivalence checker read them). Parameters that live in the sequence-parallel region (norms
between the tensor-parallel regions, the row-parallel bias added after the reduction) carry
`sequence_parallel = True` whether or not the run splits the sequence, so the flat layout does not
depend on --sequence-parallel; when it does, their gradients are partial per tensor rank and the
engine sums them over the tensor group.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_2bw.tensor_parallel.initialize import normal_shard
from megatron_2bw.tensor_parallel.mappings import (TPGroup, gather_from_tp_region, gather_linear,
                                                   reduce_from_tp_region, reduce_output,
                                                   scatter_to_tp_region)


def set_partition_attrs(param: nn.Parameter, partition_dim: int | None) -> nn.Parameter:
    param.tensor_model_parallel = partition_dim is not None
    param.partition_dim = partition_dim
    return param


def shard_box(local_shape, partition_dim: int | None, rank: int, size: int
              ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(full shape, offsets of the shard in it) of tensor rank `rank`'s shard of `size`: the
    rank-th of `size` equal contiguous chunks along `partition_dim` (what sharded_normal draws,
    what torch.cat along partition_dim undoes); a replicated parameter (None) is the whole."""
    shape = tuple(int(s) for s in local_shape)
    offsets = [0] * len(shape)
    if partition_dim is None:
        return shape, tuple(offsets)
    full = list(shape)
    full[partition_dim] *= size
    offsets[partition_dim] = rank * shape[partition_dim]
    return tuple(full), tuple(offsets)


def mark_sequence_parallel(*modules: nn.Module) -> None:
    """Tag the parameters of `modules` as living in the sequence-parallel region."""
    for module in modules:
        for p in module.parameters():
            p.sequence_parallel = True


def sharded_normal(shape: tuple, std: float, dim: int, tp: TPGroup) -> nn.Parameter:
    """The tp.rank-th chunk along `dim` of a full normal(0, std) tensor (only the chunk is
    allocated)."""
    shard = normal_shard(shape, std, dim, tp.rank, tp.size)
    return set_partition_attrs(nn.Parameter(shard), dim)


def _div(n: int, tp: TPGroup, what: str) -> int:
    if n % tp.size:
        raise ValueError(f"{what} {n} is not divisible by the tensor-parallel size {tp.size}")
    return n // tp.size


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A split along its output rows: each rank computes Y's column chunk."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup = TPGroup(),
                 bias: bool = True, gather_output: bool = False, init_std: float = 0.02):
        super().__init__()
        self.tp, self.gather_output = tp, gather_output
        self.out_local = _div(out_features, tp, "output size")
        self.weight = sharded_normal((out_features, in_features), init_std, 0, tp)
        self.bias = set_partition_attrs(nn.Parameter(torch.zeros(self.out_local)), 0) \
            if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = gather_linear(x, self.weight, self.bias, self.tp)
        return gather_from_tp_region(y, self.tp) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A split along its input columns; partial results are all-reduced.
    The bias is replicated and added after the reduction."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup = TPGroup(),
                 bias: bool = True, input_is_parallel: bool = True, init_std: float = 0.02):
        super().__init__()
        self.tp, self.input_is_parallel = tp, input_is_parallel
        _div(in_features, tp, "input size")
        self.weight = sharded_normal((out_features, in_features), init_std, 1, tp)
        self.bias = set_partition_attrs(nn.Parameter(torch.zeros(out_features)), None) \
            if bias else None
        if self.bias is not None:
            self.bias.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.tp)
        y = reduce_output(F.linear(x, self.weight), self.tp)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split across ranks: each rank looks up the tokens in its
    range, zeros the others, and the partial embeddings are all-reduced."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup = TPGroup(),
                 init_std: float = 0.02):
        super().__init__()
        self.tp = tp
        per = _div(vocab_size, tp, "vocabulary size (pad it with --make-vocab-size-divisible-by)")
        self.start, self.end = tp.rank * per, (tp.rank + 1) * per
        self.weight = sharded_normal((vocab_size, hidden_size), init_std, 0, tp)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(tokens, self.weight)
        outside = (tokens < self.start) | (tokens >= self.end)
        local = (tokens - self.start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp_region(out, self.tp)
