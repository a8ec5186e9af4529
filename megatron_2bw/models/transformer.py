"""The Megatron transformer layer with tensor-parallel attention heads and MLP.

Pre-LayerNorm; attention: column-parallel fused QKV (laid out per head, so a contiguous split is a
split by heads), this rank's heads, row-parallel output projection; MLP: column-parallel fc1,
GeLU, row-parallel fc2. Dropout on the residual branches uses the default generator (same on all
tensor ranks); attention dropout runs under the tracker's tensor-parallel generator.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..tensor_parallel import (ColumnParallelLinear, RNGTracker, RowParallelLinear, TPGroup,
                               set_partition_attrs)


class TransformerLayer(nn.Module):
    """x [b, s, h] (and an optional boolean key-padding mask [b, s], True = keep) -> [b, s, h]"""

    def __init__(self, cfg: ModelConfig, tp: TPGroup = TPGroup(), tracker: RNGTracker | None = None,
                 causal: bool = True):
        super().__init__()
        h, std = cfg.hidden_size, cfg.init_method_std
        out_std = std / math.sqrt(2.0 * cfg.num_layers)  # Megatron's scaled init for outputs
        if cfg.num_attention_heads % tp.size:
            raise ValueError(f"--num-attention-heads {cfg.num_attention_heads} is not divisible "
                             f"by --tensor-model-parallel-size {tp.size}")
        self.heads = cfg.num_attention_heads // tp.size
        self.head_dim = h // cfg.num_attention_heads
        self.causal, self.tracker = causal, tracker
        self.attention_dropout = cfg.attention_dropout
        self.input_layernorm = nn.LayerNorm(h, eps=cfg.layernorm_epsilon)
        self.qkv = ColumnParallelLinear(h, 3 * h, tp, bias=False, init_std=std)
        # query and value biases per head; no key bias: softmax is invariant to it, so its
        # gradient is exactly zero and it would only collect rounding noise (amplified by Adam)
        self.qv_bias = set_partition_attrs(
            nn.Parameter(torch.zeros(self.heads, 2, self.head_dim)), 0)
        self.proj = RowParallelLinear(h, h, tp, init_std=out_std)
        self.post_attention_layernorm = nn.LayerNorm(h, eps=cfg.layernorm_epsilon)
        self.fc1 = ColumnParallelLinear(h, cfg.ffn_size, tp, init_std=std)
        self.fc2 = RowParallelLinear(cfg.ffn_size, h, tp, init_std=out_std)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def attention(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, s, _ = x.shape
        q_bias, v_bias = self.qv_bias.unbind(1)
        bias = torch.stack([q_bias, torch.zeros_like(q_bias), v_bias], dim=1).reshape(-1)
        qkv = self.qkv(x) + bias
        q, k, v = qkv.view(b, s, self.heads, 3, self.head_dim).unbind(3)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        attn_mask = None if mask is None else mask[:, None, None, :]
        p = self.attention_dropout if self.training else 0.0
        if p > 0 and self.tracker is not None:
            with self.tracker.fork():
                out = F.scaled_dot_product_attention(q, k, v, attn_mask, p, self.causal)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask, p, self.causal)
        return self.proj(out.transpose(1, 2).reshape(b, s, -1))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.input_layernorm(x), mask))
        y = self.fc2(F.gelu(self.fc1(self.post_attention_layernorm(x))))
        return x + self.dropout(y)
