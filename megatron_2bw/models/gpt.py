"""A Megatron-shaped GPT built from layer specs: embedding | N pre-norm transformer layers | head.

The GPT-2 shape by default (learned positions, LayerNorm, GeLU, biases); the architecture flags
(config/schema.py) give the Llama shape (RoPE, RMSNorm, SwiGLU, grouped-query attention, no biases).

The output layer reuses the word embedding (tied, key "word_embeddings") unless
`untie_embeddings_and_output_weights` is set. The embedding, the output layer and the loss are
vocab-parallel; the same spec list builds the one-process sequential model (tp size 1) and any
pipeline stage of any tensor size.

With `reset_attention_mask` (--reset-attention-mask) the embedding returns (hidden, document
ids), every layer takes and passes on the pair and attends within each document
(models/documents.py), and the head drops the ids; without it the layers see the hidden state
alone.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_2bw.config import ModelConfig
from megatron_2bw.models.documents import DocumentMasks, document_ids
from megatron_2bw.models.norms import build_norm
from megatron_2bw.models.partition import split_evenly
from megatron_2bw.models.stage import LayerSpec
from megatron_2bw.models.transformer import (SequenceDropout, TransformerLayer,
                                             transformer_draws_random)
from megatron_2bw.tensor_parallel import (RNGTracker, TPGroup, VocabParallelEmbedding,
                                          gather_linear, mark_sequence_parallel,
                                          scatter_to_sequence_parallel_region,
                                          vocab_parallel_cross_entropy)
from megatron_2bw.tensor_parallel.layers import sharded_normal

TIED_KEY = "word_embeddings"


def mark_embedding_or_output(param: nn.Parameter) -> nn.Parameter:
    """Megatron's `is_embedding_or_output_parameter`: the input word embedding and the output
    layer, which --decoupled-lr steps at their own lr (optim/lr.py)."""
    param.is_embedding_or_output_parameter = True
    return param


def tied_init(cfg: ModelConfig, tp: TPGroup):
    """Re-initialize a (sharded) tied embedding from the current RNG, identically on every stage."""
    def init(param: torch.Tensor) -> None:
        param.copy_(sharded_normal((cfg.vocab_size, cfg.hidden_size), cfg.init_method_std, 0, tp))
    return init


class GPTEmbedding(nn.Module):
    """tokens [b, s] (int64) -> hidden [b, s, h] (sequence-parallel: this rank's [b, s/t, h])"""

    def __init__(self, cfg: ModelConfig, tp: TPGroup = TPGroup(),
                 tracker: RNGTracker | None = None):
        super().__init__()
        self.tp = tp
        self.word_embeddings = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp,
                                                      cfg.init_method_std)
        mark_embedding_or_output(self.word_embeddings.weight)
        self.position_embeddings = learned_positions(cfg)
        self.dropout = SequenceDropout(cfg.hidden_dropout, tp, tracker)
        self.reset_after = cfg.eod_token if cfg.reset_position_ids else None
        self.documents_end_at = cfg.eod_token if cfg.reset_attention_mask else None

    def forward(self, tokens: torch.Tensor):
        x = self.word_embeddings(tokens)
        if self.position_embeddings is not None:
            positions = torch.arange(tokens.shape[1], device=tokens.device) \
                if self.reset_after is None else reset_positions(tokens, self.reset_after)
            x = x + self.position_embeddings(positions)
        x = self.dropout(scatter_to_sequence_parallel_region(x, self.tp))
        if self.documents_end_at is None:
            return x
        return x, document_ids(tokens, self.documents_end_at)


class GPTDocumentLayer(TransformerLayer):
    """--reset-attention-mask: (x, document ids) -> (x', the same ids), attending within each
    document; the layers of a model share `masks` (one mask per microbatch and stage)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, tracker: RNGTracker, masks: DocumentMasks):
        super().__init__(cfg, tp, tracker, causal=True)
        self.masks = masks

    def forward(self, x: torch.Tensor, ids: torch.Tensor | None = None):  # type: ignore[override]
        if ids is None:  # the hidden state alone (a profiler's layer): plain causal
            return super().forward(x)
        mask, ids = self.masks(ids)
        return super().forward(x, mask), ids


def reset_positions(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """--reset-position-ids: position ids [b, s] that restart at 0 after every `eod` token
    (Megatron's get_ltor_masks_and_position_ids)."""
    idx = torch.arange(tokens.shape[1], device=tokens.device)
    after = torch.where(tokens == eod, idx + 1, torch.zeros_like(idx))  # j + 1 at each eod j
    start = torch.cummax(after, dim=1).values
    start = torch.cat([torch.zeros_like(start[:, :1]), start[:, :-1]], dim=1)  # eods before i
    return idx - start


def learned_positions(cfg: ModelConfig, init: bool = True) -> nn.Embedding | None:
    """The learned absolute position table (normal(0, init std) unless `init` is False), or None
    with RoPE (the attention rotates instead)."""
    if cfg.position_embedding_type != "learned_absolute":
        return None
    table = nn.Embedding(cfg.max_positions, cfg.hidden_size)
    if init:
        nn.init.normal_(table.weight.data, std=cfg.init_method_std)
    return table


class GPTHead(nn.Module):
    """Final LayerNorm and the vocab-parallel output layer: [b, s, h] -> logits [b, s, vocab/t]."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup = TPGroup()):
        super().__init__()
        self.tp = tp
        self.final_layernorm = build_norm(cfg)
        mark_sequence_parallel(self.final_layernorm)
        self.weight = mark_embedding_or_output(
            sharded_normal((cfg.vocab_size, cfg.hidden_size), cfg.init_method_std, 0, tp))

    def forward(self, x: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
        return gather_linear(self.final_layernorm(x), self.weight, None, self.tp)


def gpt_layer_specs(cfg: ModelConfig, tp: TPGroup = TPGroup(), seed: int = 1234,
                    ) -> list[LayerSpec]:
    tracker = RNGTracker(seed, tp.rank)
    tied = None if cfg.untie_embeddings_and_output_weights else TIED_KEY
    init = tied_init(cfg, tp)
    specs = [LayerSpec(lambda: GPTEmbedding(cfg, tp, tracker), name="embedding", tied_key=tied,
                       tied_attr="word_embeddings.weight", tied_init=init,
                       random=cfg.hidden_dropout > 0)]
    if cfg.reset_attention_mask:
        masks = DocumentMasks()
        layer = lambda: GPTDocumentLayer(cfg, tp, tracker, masks)  # noqa: E731
    else:
        layer = lambda: TransformerLayer(cfg, tp, tracker, causal=True)  # noqa: E731
    specs += [LayerSpec(layer, name="transformer", recompute=True, tracker=tracker,
                        random=transformer_draws_random(cfg))
              for _ in range(cfg.num_layers)]
    specs.append(LayerSpec(lambda: GPTHead(cfg, tp), name="head", tied_key=tied, tied_attr="weight",
                           tied_init=init, random=False))
    return specs


def gpt_partition(cfg: ModelConfig, num_stages: int) -> list[int]:
    """Spec-index boundaries: transformer layers split evenly, embedding on the first stage and the
    head on the last."""
    bounds = [b + 1 for b in split_evenly(cfg.num_layers, num_stages)]
    bounds[0], bounds[-1] = 0, cfg.num_layers + 2
    return bounds


def make_gpt_loss(tp: TPGroup = TPGroup(), masked: bool = False):
    def gpt_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross entropy over the microbatch (vocab-parallel, fp32 math)."""
        return vocab_parallel_cross_entropy(logits, labels, tp).mean()

    def masked_gpt_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """--eod-mask-loss: the mean over the positions with a label >= 0 (Megatron's
        sum(loss * mask) / sum(mask) per microbatch)."""
        keep = labels >= 0
        losses = vocab_parallel_cross_entropy(logits, labels.clamp(min=0), tp)
        return (losses * keep).sum() / keep.sum().clamp(min=1)
    return masked_gpt_loss if masked else gpt_loss


gpt_loss = make_gpt_loss()
