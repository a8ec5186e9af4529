"""The normalization layers (`--normalization`): LayerNorm (weight and bias) or RMSNorm (weight
only: x / sqrt(mean(x^2) + eps) * weight, computed in fp32 and cast back, as Megatron and
HuggingFace's Llama do). Both keep Megatron's parameter names `weight` (and `bias`)."""
from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def build_norm(cfg: ModelConfig, hidden_size: int | None = None) -> nn.Module:
    h = hidden_size or cfg.hidden_size
    if cfg.normalization == "RMSNorm":
        return RMSNorm(h, cfg.layernorm_epsilon)
    return nn.LayerNorm(h, eps=cfg.layernorm_epsilon)


def norm_params(cfg: ModelConfig) -> int:
    """Parameters of one normalization layer (models/flops.py counts with it)."""
    return cfg.hidden_size * (1 if cfg.normalization == "RMSNorm" else 2)
