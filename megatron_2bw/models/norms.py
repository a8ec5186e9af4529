"""The normalization layers (`--normalization`): LayerNorm (weight and bias) or RMSNorm (weight
only). Both keep Megatron's parameter names `weight` (and `bias`); with --apply-layernorm-1p the
weight holds gamma - 1 (Megatron's zero-centred gamma: zero at init, applied as 1 + weight).

RMSNorm computes y = weight * (x / sqrt(mean(x^2) + eps)) in fp32 and casts the normalized value
back to the input's dtype before the weight, exactly as HuggingFace's Llama does, so the two
models agree to rounding. Its backward keeps only x and the fp32 reciprocal root [.., 1], as
LayerNorm's does (no normalized copy): the stash models/flops.py counts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_2bw.config import ModelConfig
from megatron_2bw.models.norm_sizes import norm_params, norm_stats_bytes  # noqa: F401


def _normalize(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / rms(x), 1 / rms(x) [.., 1]), in fp32 (or x's dtype when wider)"""
    y = x.float() if x.element_size() < 4 else x
    rstd = torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return y * rstd, rstd


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        n, rstd = _normalize(x, eps)
        ctx.save_for_backward(x, weight, rstd)
        return weight * n.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        wide = rstd.dtype
        n = x.to(wide) * rstd
        g = grad.to(wide)
        grad_weight = (g * n.to(x.dtype).to(wide)).sum(dim=tuple(range(g.dim() - 1)))
        dn = g * weight.to(wide)
        grad_x = rstd * (dn - n * (dn * n).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight.to(weight.dtype), None


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-5, one_plus: bool = False):
        super().__init__()
        self.eps, self.one_plus = eps, one_plus
        self.weight = nn.Parameter(torch.zeros(hidden_size) if one_plus else
                                   torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.one_plus else self.weight
        return _RMSNorm.apply(x, weight, self.eps)


class LayerNorm1P(nn.LayerNorm):
    """--apply-layernorm-1p: the weight holds gamma - 1 (zero at init; weight decay pulls gamma
    towards 1), Megatron's zero-centred gamma: y = layer_norm(x) * (1 + weight) + bias."""

    def __init__(self, hidden_size: int, eps: float = 1e-5):
        super().__init__(hidden_size, eps=eps)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


def build_norm(cfg: ModelConfig, hidden_size: int | None = None) -> nn.Module:
    h = hidden_size or cfg.hidden_size
    if cfg.normalization == "RMSNorm":
        return RMSNorm(h, cfg.layernorm_epsilon, one_plus=cfg.apply_layernorm_1p)
    if cfg.apply_layernorm_1p:
        return LayerNorm1P(h, eps=cfg.layernorm_epsilon)
    return nn.LayerNorm(h, eps=cfg.layernorm_epsilon)
