"""A Megatron-shaped BERT from layer specs: embedding | N bidirectional transformer layers | heads.

Inputs of the first stage: (tokens [b, s] int64, token types [b, s] int64, padding mask [b, s]
bool, True = real token). Between stages: (hidden [b, s, h], padding mask). Output of the last
stage: (vocab-parallel MLM logits [b, s, vocab/t], binary logits [b, 2] or None). The MLM output
layer is tied to the word embedding (key "word_embeddings").
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatron_2bw.config import ModelConfig
from megatron_2bw.models.gpt import (TIED_KEY, gpt_partition, learned_positions,
                                     mark_embedding_or_output, tied_init)
from megatron_2bw.models.norms import build_norm
from megatron_2bw.models.stage import LayerSpec
from megatron_2bw.models.transformer import (SequenceDropout, TransformerLayer,
                                             transformer_draws_random)
from megatron_2bw.tensor_parallel import (RNGTracker, TPGroup, VocabParallelEmbedding,
                                          copy_to_tp_region, gather_from_sequence_parallel_region,
                                          mark_sequence_parallel,
                                          scatter_to_sequence_parallel_region, set_partition_attrs,
                                          vocab_parallel_cross_entropy)
from megatron_2bw.tensor_parallel.layers import sharded_normal


class BertEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup = TPGroup(),
                 tracker: RNGTracker | None = None):
        super().__init__()
        self.tp = tp
        std = cfg.init_method_std
        self.word_embeddings = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, std)
        mark_embedding_or_output(self.word_embeddings.weight)
        self.position_embeddings = learned_positions(cfg, init=False)
        self.tokentype_embeddings = nn.Embedding(cfg.num_tokentypes, cfg.hidden_size)
        for emb in (self.position_embeddings, self.tokentype_embeddings):
            if emb is not None:
                nn.init.normal_(emb.weight.data, std=std)
        self.dropout = SequenceDropout(cfg.hidden_dropout, tp, tracker)

    def forward(self, tokens, token_types, padding_mask):
        x = self.word_embeddings(tokens) + self.tokentype_embeddings(token_types)
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(torch.arange(tokens.shape[1], device=tokens.device))
        x = scatter_to_sequence_parallel_region(x, self.tp)
        return self.dropout(x), padding_mask.bool()


class BertLayer(TransformerLayer):
    def forward(self, x, padding_mask):  # type: ignore[override]
        return super().forward(x, padding_mask), padding_mask


class BertHeads(nn.Module):
    """Final LayerNorm, the MLM head (dense + GeLU + LayerNorm + tied vocab-parallel output +
    bias) and the binary (next-sentence / sentence-order) head on the pooled first token."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup = TPGroup()):
        super().__init__()
        h, std = cfg.hidden_size, cfg.init_method_std
        self.tp, self.binary = tp, cfg.bert_binary_head
        self.final_layernorm = build_norm(cfg)
        mark_sequence_parallel(self.final_layernorm)
        self.lm_dense = nn.Linear(h, h)
        self.lm_layernorm = nn.LayerNorm(h, eps=cfg.layernorm_epsilon)
        self.weight = mark_embedding_or_output(sharded_normal((cfg.vocab_size, h), std, 0, tp))
        self.lm_bias = set_partition_attrs(nn.Parameter(torch.zeros(cfg.vocab_size // tp.size)), 0)
        if self.binary:
            self.pooler = nn.Linear(h, h)
            self.binary_head = nn.Linear(h, 2)
        for lin in [self.lm_dense] + ([self.pooler, self.binary_head] if self.binary else []):
            nn.init.normal_(lin.weight.data, std=std)
            nn.init.zeros_(lin.bias.data)

    def forward(self, x, padding_mask):
        # the heads are replicated (complete gradients): the gather's backward keeps the chunk
        x = gather_from_sequence_parallel_region(self.final_layernorm(x), self.tp)
        y = self.lm_layernorm(F.gelu(self.lm_dense(x)))
        lm_logits = F.linear(copy_to_tp_region(y, self.tp), self.weight, self.lm_bias)
        binary = self.binary_head(torch.tanh(self.pooler(x[:, 0]))) if self.binary else None
        return lm_logits, binary


def bert_layer_specs(cfg: ModelConfig, tp: TPGroup = TPGroup(), seed: int = 1234
                     ) -> list[LayerSpec]:
    tracker = RNGTracker(seed, tp.rank)
    init = tied_init(cfg, tp)
    specs = [LayerSpec(lambda: BertEmbedding(cfg, tp, tracker), name="embedding",
                       tied_key=TIED_KEY,
                       tied_attr="word_embeddings.weight", tied_init=init,
                       random=cfg.hidden_dropout > 0)]
    specs += [LayerSpec(lambda: BertLayer(cfg, tp, tracker, causal=False), name="transformer",
                        recompute=True, tracker=tracker, random=transformer_draws_random(cfg))
              for _ in range(cfg.num_layers)]
    specs.append(LayerSpec(lambda: BertHeads(cfg, tp), name="heads", tied_key=TIED_KEY,
                           tied_attr="weight", tied_init=init, random=False))
    return specs


bert_partition = gpt_partition


def make_bert_loss(tp: TPGroup = TPGroup()):
    def bert_loss(outputs, labels) -> torch.Tensor:
        """Masked-LM loss averaged over masked tokens, plus the binary head's cross entropy."""
        lm_logits, binary = outputs
        lm_labels, loss_mask, sentence_order = labels
        per_token = vocab_parallel_cross_entropy(lm_logits, lm_labels.clamp_min(0), tp)
        mask = loss_mask.float()
        loss = (per_token * mask).sum() / mask.sum().clamp_min(1.0)
        if binary is not None:
            loss = loss + F.cross_entropy(binary.float(), sentence_order)
        return loss
    return bert_loss
