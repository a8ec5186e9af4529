"""Self-attention with tensor-parallel heads, grouped-query attention and RoPE.

Heads come in `query_groups` groups (`--num-query-groups` with `--group-query-attention`, else
one group per head); each group has P = heads / groups query heads and one key and one value
head. The fused column-parallel QKV weight [groups * (P + 2) * d, h] (d = kv_channels) is laid
out group by group, each group as [q_1 .. q_P, k, v] (Megatron's layout), so a contiguous split
across tensor ranks is a split by whole groups: every rank holds groups / t groups (the config
checks that they divide). With one group per head this is the classic per-head [q, k, v].

Biases (unless `--disable-bias-linear`): `qv_bias` [groups, P + 1, d] holds the query and value
biases; there is no key bias: softmax is invariant to it, so its gradient is exactly zero and it
would only collect rounding noise (amplified by Adam). The output projection is row-parallel.
`--qk-layernorm`: a norm (LayerNorm or RMSNorm, as --normalization) over each query and key head's
kv_channels, after the biases and before RoPE (Megatron's q_layernorm / k_layernorm).

Selective recomputation (`--recompute-activations`, Megatron's meaning): core attention, the
softmax and dropout over the scores and the weighted sum of the values, keeps only q, k and v
for the backward and runs again there, under the random state of its forward (the same dropout
mask); everything else keeps its activations. Under sequence parallelism x is this rank's
sequence chunk and the QKV projection gathers the whole sequence.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_2bw.config import ModelConfig
from megatron_2bw.models.norms import build_norm
from megatron_2bw.models.recompute import recompute
from megatron_2bw.models.rope import RotaryEmbedding
from megatron_2bw.tensor_parallel import (ColumnParallelLinear, RNGTracker, RowParallelLinear,
                                          TPGroup, mark_sequence_parallel, set_partition_attrs)

# scaled_dot_product_attention broadcasts key/value groups itself from torch 2.5 on
_NATIVE_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


def _divide(n: int, tp: TPGroup, flag: str) -> int:
    if n % tp.size:
        raise ValueError(f"{flag} {n} is not divisible by --tensor-model-parallel-size {tp.size}")
    return n // tp.size


class SelfAttention(nn.Module):
    """x [b, s, h] and an optional boolean mask, True = attend: a key-padding mask [b, s] (BERT),
    or a whole mask [b, 1, s, s] that holds the causality too (--reset-attention-mask,
    models/documents.py) -> [b, s, h]"""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, tracker: RNGTracker | None, causal: bool,
                 init_std: float, out_std: float):
        super().__init__()
        h, d = cfg.hidden_size, cfg.kv_channels
        self.heads = _divide(cfg.num_attention_heads, tp, "--num-attention-heads")
        self.groups = _divide(cfg.query_groups, tp, "--num-query-groups" if
                              cfg.group_query_attention else "--num-attention-heads")
        self.per_group, self.head_dim = self.heads // self.groups, d
        self.causal, self.tracker, self.attention_dropout = causal, tracker, cfg.attention_dropout
        self.selective = cfg.selective_recompute
        width = (cfg.num_attention_heads + 2 * cfg.query_groups) * d
        self.qkv = ColumnParallelLinear(h, width, tp, bias=False, init_std=init_std)
        self.qv_bias = set_partition_attrs(nn.Parameter(
            torch.zeros(self.groups, self.per_group + 1, d)), 0) if cfg.add_bias_linear else None
        self.proj = RowParallelLinear(cfg.num_attention_heads * d, h, tp,
                                      bias=cfg.add_bias_linear, init_std=out_std)
        self.rope = RotaryEmbedding(cfg.rotary_dim, cfg.rotary_base) \
            if cfg.position_embedding_type == "rope" else None
        self.q_layernorm = self.k_layernorm = None
        if cfg.qk_layernorm:  # --qk-layernorm: a norm over each query and key head's channels
            self.q_layernorm, self.k_layernorm = build_norm(cfg, d), build_norm(cfg, d)
            # replicated, but each tensor rank's gradient covers only its heads: summed over the
            # tensor group with the sequence-parallel parameters (the config asks for
            # --sequence-parallel when t > 1)
            mark_sequence_parallel(self.q_layernorm, self.k_layernorm)

    def _qkv(self, x: torch.Tensor):
        P = self.per_group
        qkv = self.qkv(x)
        b, s = qkv.shape[:2]  # the whole sequence (x may be a sequence-parallel chunk)
        qkv = qkv.view(b, s, self.groups, P + 2, self.head_dim)
        if self.qv_bias is not None:
            q_bias, v_bias = self.qv_bias.split([P, 1], dim=1)
            qkv = qkv + torch.cat([q_bias, torch.zeros_like(v_bias), v_bias], dim=1)
        q = qkv[:, :, :, :P].reshape(b, s, self.heads, self.head_dim)
        k, v = qkv[:, :, :, P], qkv[:, :, :, P + 1]
        if self.q_layernorm is not None:  # before RoPE, as Megatron
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads or groups, s, d]
        if self.rope is not None:
            cos, sin = self.rope.cos_sin(s, x.device, q.dtype)
            q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        return q, k, v

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self._qkv(x)
        b, s = q.shape[0], q.shape[2]
        if self.selective and torch.is_grad_enabled():
            out = recompute(lambda q_, k_, v_: self._core(q_, k_, v_, mask), self.tracker,
                            q, k, v)
        else:
            out = self._core(q, k, v, mask)
        return self.proj(out.transpose(1, 2).reshape(b, s, -1))

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              mask: torch.Tensor | None) -> torch.Tensor:
        """Core attention: softmax and dropout over the scores, weighted sum of the values."""
        extra = {}
        if self.per_group > 1:
            if _NATIVE_GQA:
                extra["enable_gqa"] = True
            else:
                k, v = (t.repeat_interleave(self.per_group, dim=1) for t in (k, v))
        attn_mask, causal = mask, self.causal
        if mask is not None and mask.dim() == 2:
            attn_mask = mask[:, None, None, :]
        elif mask is not None:
            causal = False  # the whole mask is causal itself
        p = self.attention_dropout if self.training else 0.0
        if p > 0 and self.tracker is not None:
            with self.tracker.fork():
                out = F.scaled_dot_product_attention(q, k, v, attn_mask, p, causal, **extra)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask, p, causal, **extra)
        return out
