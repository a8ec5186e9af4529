"""The Megatron transformer layer: pre-norm self-attention and MLP, each with a residual.

    x = x + dropout(self_attention(input_layernorm(x)))      models/attention.py
    x = x + dropout(mlp(post_attention_layernorm(x)))         models/mlp.py

The norms are LayerNorm or RMSNorm (models/norms.py); attention heads and MLP columns are split
across tensor ranks. Dropout on the residual branches uses the default generator (same on all
tensor ranks); attention dropout runs under the tracker's tensor-parallel generator.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..config import ModelConfig
from ..tensor_parallel import RNGTracker, TPGroup
from .attention import SelfAttention
from .mlp import MLP
from .norms import build_norm


def transformer_draws_random(cfg: ModelConfig) -> bool:
    """Whether a training forward of this layer draws random numbers (its dropouts)."""
    return cfg.hidden_dropout > 0 or cfg.attention_dropout > 0


class TransformerLayer(nn.Module):
    """x [b, s, h] (and an optional boolean key-padding mask [b, s], True = keep) -> [b, s, h]"""

    def __init__(self, cfg: ModelConfig, tp: TPGroup = TPGroup(), tracker: RNGTracker | None = None,
                 causal: bool = True):
        super().__init__()
        std = cfg.init_method_std
        out_std = std / math.sqrt(2.0 * cfg.num_layers)  # Megatron's scaled init for outputs
        self.input_layernorm = build_norm(cfg)
        self.self_attention = SelfAttention(cfg, tp, tracker, causal, std, out_std)
        self.post_attention_layernorm = build_norm(cfg)
        self.mlp = MLP(cfg, tp, std, out_std)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.dropout(self.self_attention(self.input_layernorm(x), mask))
        return x + self.dropout(self.mlp(self.post_attention_layernorm(x)))
