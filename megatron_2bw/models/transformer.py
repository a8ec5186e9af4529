"""The Megatron transformer layer: pre-norm self-attention and MLP, each with a residual.

    x = x + dropout(self_attention(input_layernorm(x)))      models/attention.py
    x = x + dropout(mlp(post_attention_layernorm(x)))         models/mlp.py

The norms are LayerNorm or RMSNorm (models/norms.py); attention heads and MLP columns are split
across tensor ranks. Dropout on the residual branches uses the default generator (same on all
tensor ranks); attention dropout runs under the tracker's tensor-parallel generator.

Sequence parallelism (`tp.sequence_parallel`, --sequence-parallel): x is this tensor rank's
chunk [b, s/t, h] of the sequence; the norms, the residual adds and their dropout work on the
chunk (dropout under the tracker's generator: each rank draws the mask of its own chunk); the
attention's QKV and the MLP's fc1 all-gather the normalized chunk, their output projections
reduce-scatter back to it.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from megatron_2bw.config import ModelConfig
from megatron_2bw.models.attention import SelfAttention
from megatron_2bw.models.mlp import MLP
from megatron_2bw.models.norms import build_norm
from megatron_2bw.tensor_parallel import RNGTracker, TPGroup, mark_sequence_parallel


def transformer_draws_random(cfg: ModelConfig) -> bool:
    """Whether a training forward of this layer draws random numbers (its dropouts)."""
    return cfg.hidden_dropout > 0 or cfg.attention_dropout > 0


class TransformerLayer(nn.Module):
    """x [b, s, h] (and an optional boolean mask, True = attend: SelfAttention's) -> [b, s, h]"""

    def __init__(self, cfg: ModelConfig, tp: TPGroup = TPGroup(), tracker: RNGTracker | None = None,
                 causal: bool = True):
        super().__init__()
        std = cfg.init_method_std
        out_std = std / math.sqrt(2.0 * cfg.num_layers)  # Megatron's scaled init for outputs
        self.input_layernorm = build_norm(cfg)
        self.self_attention = SelfAttention(cfg, tp, tracker, causal, std, out_std)
        self.post_attention_layernorm = build_norm(cfg)
        self.mlp = MLP(cfg, tp, std, out_std)
        self.dropout = SequenceDropout(cfg.hidden_dropout, tp, tracker)
        mark_sequence_parallel(self.input_layernorm, self.post_attention_layernorm)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.dropout(self.self_attention(self.input_layernorm(x), mask))
        return x + self.dropout(self.mlp(self.post_attention_layernorm(x)))


class SequenceDropout(nn.Dropout):
    """Dropout of activations outside the tensor-parallel regions: the default generator (the
    same mask on every tensor rank of replicated activations), or under sequence parallelism the
    tracker's per-rank generator (each rank holds another chunk of the sequence)."""

    def __init__(self, p: float, tp: TPGroup, tracker: RNGTracker | None):
        super().__init__(p)
        self.tracker = tracker if tp.split_sequence else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tracker is None or not self.training or self.p == 0:
            return super().forward(x)
        with self.tracker.fork():
            return super().forward(x)
