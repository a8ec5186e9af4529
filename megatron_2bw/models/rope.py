"""Rotary position embeddings (`--position-embedding-type rope`), Megatron's non-interleaved form.

The first `rotary_dim` = kv_channels x `--rotary-percent` channels of every query and key head
are rotated; channel i of the first half pairs with channel i + rotary_dim/2 ("rotate half"),
at angle position x base^(-2i / rotary_dim). This is also HuggingFace Llama's convention, so
q/k projection weights map to `q_proj`/`k_proj` without any permutation. The frequencies are
computed in fp32 as HF does (positions x inverse frequencies, then cos and sin), so the two
models agree to rounding. The module holds no parameters.
"""
from __future__ import annotations

import torch
from torch import nn


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, base: float = 10000.0):
        super().__init__()
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32)
                                   / rotary_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, seq_len: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [seq_len, rotary_dim] for positions 0 .. seq_len - 1."""
        positions = torch.arange(seq_len, device=device, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq.to(device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [b, heads, s, head_dim] -> x with its first rotary_dim channels rotated."""
        r = self.rotary_dim
        if r == x.shape[-1]:
            return x * cos + _rotate_half(x) * sin
        rot, rest = x[..., :r], x[..., r:]
        return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)
