"""Deterministic synthetic BERT data (`pretrain_bert.py --mock-data`) and the BERT microbatch
iterator shared with the real BERT dataset (same sample dict as Megatron's).

A mock sample is two segments of an arithmetic progression modulo the vocabulary; with
probability 1/2 they are swapped (the sentence-order label). 15% of the content tokens are
selected for prediction (80% [MASK], 10% a random token, 10% unchanged); some samples are short
and padded.
"""
from __future__ import annotations

import torch

from megatron_2bw.data.mock import MicrobatchIterator

PAD, CLS, SEP, MASK = 0, 1, 2, 3
NUM_SPECIAL = 4


class MockBertDataset:
    def __init__(self, vocab_size: int, seq_length: int, seed: int = 1234,
                 mask_prob: float = 0.15, short_seq_prob: float = 0.1):
        if vocab_size <= NUM_SPECIAL + 1:
            raise ValueError(f"vocabulary size {vocab_size} too small for mock BERT data")
        self.vocab_size, self.seq_length, self.seed = vocab_size, seq_length, seed
        self.mask_prob, self.short_seq_prob = mask_prob, short_seq_prob

    def __len__(self) -> int:
        return 2 ** 62

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + int(idx) + 7)
        s, content = self.seq_length, self.vocab_size - NUM_SPECIAL
        n = s - 3
        if float(torch.rand(1, generator=g)) < self.short_seq_prob:
            n = int(torch.randint(2, max(n, 3), (1,), generator=g))
        start = int(torch.randint(content, (1,), generator=g))
        stride = int(torch.randint(1, 8, (1,), generator=g))
        seq = (start + stride * torch.arange(n)) % content + NUM_SPECIAL
        half = max(1, n // 2)
        a, b = seq[:half], seq[half:]
        swapped = bool(torch.rand(1, generator=g) < 0.5)
        if swapped:
            a, b = b, a
        tokens = torch.cat([torch.tensor([CLS]), a, torch.tensor([SEP]), b, torch.tensor([SEP])])
        types = torch.cat([torch.zeros(len(a) + 2, dtype=torch.long),
                           torch.ones(len(b) + 1, dtype=torch.long)])
        real = len(tokens)
        content_pos = torch.tensor([i for i in range(real) if tokens[i] >= NUM_SPECIAL])
        num_pred = max(1, int(round(self.mask_prob * len(content_pos))))
        chosen = content_pos[torch.randperm(len(content_pos), generator=g)[:num_pred]]
        labels = torch.full((s,), -1, dtype=torch.long)
        labels[chosen] = tokens[chosen]
        loss_mask = torch.zeros(s, dtype=torch.long)
        loss_mask[chosen] = 1
        r = torch.rand(len(chosen), generator=g)
        rand_tok = torch.randint(NUM_SPECIAL, self.vocab_size, (len(chosen),), generator=g)
        tokens[chosen] = torch.where(r < 0.8, torch.full_like(rand_tok, MASK),
                                     torch.where(r < 0.9, rand_tok, tokens[chosen]))
        pad = s - real
        return {"tokens": torch.cat([tokens, torch.full((pad,), PAD)]),
                "types": torch.cat([types, torch.zeros(pad, dtype=torch.long)]),
                "labels": labels, "loss_mask": loss_mask,
                "padding_mask": torch.cat([torch.ones(real, dtype=torch.long),
                                           torch.zeros(pad, dtype=torch.long)]),
                "is_random": torch.tensor(int(swapped))}


class BertBatches(MicrobatchIterator):
    """((tokens, types, padding_mask), (labels, loss_mask, sentence_order)) microbatches for one
    data-parallel replica, in schedule order (same sample layout as GPTBatches)."""

    def collate(self, samples: list):
        col = lambda key: torch.stack([smp[key] for smp in samples])  # noqa: E731
        inputs = (col("tokens"), col("types"), col("padding_mask").bool())
        labels = (col("labels"), col("loss_mask"), col("is_random"))
        return inputs, labels
