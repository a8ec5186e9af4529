"""The transformer MLP: column-parallel fc1, activation, row-parallel fc2.

Activation: GeLU (erf form; `--openai-gelu`: the tanh approximation, GPT-2's `gelu_new`) or, with
`--swiglu`, SiLU(gate) * up. SwiGLU's fc1 is one weight [2, f/t, h] on each tensor rank: index 0
is this rank's slice of the gate matrix, index 1 its slice of the up matrix, so one matmul computes
both and the tensor-parallel split (along dim 1, `partition_dim = 1`) keeps every rank's gate and
up rows together; concatenating the shards along dim 1 gives the full [2, f, h] = [gate; up].
Biases (unless `--disable-bias-linear`): SwiGLU keeps `gate_bias` and `up_bias` [f/t] apart
(one-dimensional, so they are not weight-decayed).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_2bw.config import ModelConfig
from megatron_2bw.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, TPGroup,
                                          gather_linear, set_partition_attrs)
from megatron_2bw.tensor_parallel.layers import sharded_normal


class GatedColumnParallelLinear(nn.Module):
    """x [.., h] -> (gate, up) [.., f/t] each, from one [2, f/t, h] weight."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, bias: bool,
                 init_std: float):
        super().__init__()
        self.tp = tp
        self.weight = sharded_normal((2, out_features, in_features), init_std, 1, tp)
        local = out_features // tp.size
        self.gate_bias = set_partition_attrs(nn.Parameter(torch.zeros(local)), 0) \
            if bias else None
        self.up_bias = set_partition_attrs(nn.Parameter(torch.zeros(local)), 0) if bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = gather_linear(x, self.weight.flatten(0, 1), None, self.tp)
        gate, up = y.chunk(2, dim=-1)
        if self.gate_bias is not None:
            gate, up = gate + self.gate_bias, up + self.up_bias
        return gate, up


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, init_std: float, out_std: float):
        super().__init__()
        h, f, bias = cfg.hidden_size, cfg.ffn_size, cfg.add_bias_linear
        self.swiglu = cfg.swiglu
        self.approximate = "tanh" if cfg.openai_gelu else "none"
        if cfg.swiglu:
            self.fc1 = GatedColumnParallelLinear(h, f, tp, bias, init_std)
        else:
            self.fc1 = ColumnParallelLinear(h, f, tp, bias=bias, init_std=init_std)
        self.fc2 = RowParallelLinear(f, h, tp, bias=bias, init_std=out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate, up = self.fc1(x)
            return self.fc2(F.silu(gate) * up)
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))
