"""A Megatron-shaped GPT built from layer specs: embedding | N pre-LN transformer layers | head.

The output layer reuses the word embedding (tied, key "word_embeddings") unless
`untie_embeddings_and_output_weights` is set. The same spec list builds the one-process sequential
model and any pipeline stage.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..pipeline.module import LayerSpec, partition_uniform

TIED_KEY = "word_embeddings"


def _normal(std: float):
    def init(t: torch.Tensor) -> None:
        nn.init.normal_(t, mean=0.0, std=std)
    return init


class GPTEmbedding(nn.Module):
    """tokens [b, s] (int64) -> hidden [b, s, h]"""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_positions, cfg.hidden_size)
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        _normal(cfg.init_method_std)(self.word_embeddings.weight.data)
        _normal(cfg.init_method_std)(self.position_embeddings.weight.data)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.dropout(self.word_embeddings(tokens) + self.position_embeddings(positions))


class TransformerLayer(nn.Module):
    """Pre-LayerNorm causal self-attention + GeLU MLP, both residual. [b, s, h] -> [b, s, h]"""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, std = cfg.hidden_size, cfg.init_method_std
        self.num_heads = cfg.num_attention_heads
        self.attention_dropout = cfg.attention_dropout
        self.input_layernorm = nn.LayerNorm(h, eps=cfg.layernorm_epsilon)
        # no key bias: softmax is invariant to it, so its gradient is exactly zero and the
        # parameter would only collect rounding noise (which Adam amplifies)
        self.qkv = nn.Linear(h, 3 * h, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(h))
        self.v_bias = nn.Parameter(torch.zeros(h))
        self.proj = nn.Linear(h, h)
        self.post_attention_layernorm = nn.LayerNorm(h, eps=cfg.layernorm_epsilon)
        self.fc1 = nn.Linear(h, cfg.ffn_size)
        self.fc2 = nn.Linear(cfg.ffn_size, h)
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        out_std = std / math.sqrt(2.0 * cfg.num_layers)  # Megatron's scaled init for residual outputs
        for lin, s in ((self.qkv, std), (self.proj, out_std), (self.fc1, std), (self.fc2, out_std)):
            _normal(s)(lin.weight.data)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias.data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        bias = torch.cat([self.q_bias, self.q_bias.new_zeros(h), self.v_bias])
        qkv = F.linear(self.input_layernorm(x), self.qkv.weight, bias)
        q, k, v = qkv.view(b, s, 3, self.num_heads, -1).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        p = self.attention_dropout if self.training else 0.0
        attn = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        x = x + self.dropout(self.proj(attn.transpose(1, 2).reshape(b, s, h)))
        y = self.fc2(F.gelu(self.fc1(self.post_attention_layernorm(x))))
        return x + self.dropout(y)


class GPTHead(nn.Module):
    """Final LayerNorm and the output layer: hidden [b, s, h] -> logits [b, s, vocab]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.final_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        self.weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        _normal(cfg.init_method_std)(self.weight.data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.final_layernorm(x), self.weight)


def gpt_layer_specs(cfg: ModelConfig) -> list[LayerSpec]:
    tied = None if cfg.untie_embeddings_and_output_weights else TIED_KEY
    init = _normal(cfg.init_method_std)
    specs = [LayerSpec(lambda: GPTEmbedding(cfg), name="embedding", tied_key=tied,
                       tied_attr="word_embeddings.weight", tied_init=init)]
    specs += [LayerSpec(lambda: TransformerLayer(cfg), name="transformer")
              for _ in range(cfg.num_layers)]
    specs.append(LayerSpec(lambda: GPTHead(cfg), name="head", tied_key=tied, tied_attr="weight",
                           tied_init=init))
    return specs


def gpt_partition(cfg: ModelConfig, num_stages: int) -> list[int]:
    """Spec-index boundaries: transformer layers split evenly, embedding on the first stage and the
    head on the last."""
    bounds = [b + 1 for b in partition_uniform(cfg.num_layers, num_stages)]
    bounds[0], bounds[-1] = 0, cfg.num_layers + 2
    return bounds


def gpt_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over the microbatch, computed in fp32."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
