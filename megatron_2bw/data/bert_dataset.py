"""Megatron's BERT dataset: sentence-pair samples with masked-LM and a binary pair label.

Needs a `_sentence` indexed dataset (one sequence per sentence, documents delimit them; build it
with `tools/preprocess_data.py --split-sentences`). The sample mapping groups consecutive
sentences of one document until a target length (the full seq_length - 3, or with probability
`short_seq_prob` a random shorter one) and is cached like the GPT indices. Sample i is then
built with a RandomState seeded by (seed + i), so it depends only on i.

Pair labels (`is_random`): "sop" (Megatron's default, sentence order): segments A and B are
swapped with probability 1/2; "nsp" (next sentence): B is replaced with probability 1/2 by
sentences of another document. Masking: mask_prob of the tokens (at least one, never [CLS] or
[SEP]) become predictions; of those 80% are replaced by [MASK], 10% by a random token, 10% kept.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from megatron_2bw.data.cache import cached_arrays
from megatron_2bw.data.errors import DataError
from megatron_2bw.data.indexed_dataset import MMapIndexedDataset, index_file_path

LONG_SENTENCE = 512  # documents with a longer sentence are skipped, as in Megatron
PAIR_TASKS = ("sop", "nsp")


def check_probabilities(mask_prob: float, short_seq_prob: float) -> None:
    """--mask-prob and --short-seq-prob are probabilities (one-line DataError otherwise)."""
    for flag, value, default in (("--mask-prob", mask_prob, 0.15),
                                 ("--short-seq-prob", short_seq_prob, 0.1)):
        if not 0.0 <= value <= 1.0:
            raise DataError(f"{flag} {value}: a probability must be in [0, 1] (Megatron's "
                            f"default: {default})")


def target_length(rng: np.random.RandomState, max_len: int, short_seq_prob: float) -> int:
    if short_seq_prob > 0 and rng.random_sample() < short_seq_prob:
        return int(rng.randint(2, max_len + 1))
    return max_len


def build_sample_mapping(document_indices: np.ndarray, sizes: np.ndarray, doc_range: range,
                         num_samples: int | None, max_len: int, short_seq_prob: float,
                         seed: int, min_sentences: int) -> np.ndarray:
    """Rows (first sentence, end sentence, target length, document) shuffled by the seed; epochs
    over doc_range until num_samples rows exist (one epoch when num_samples is None)."""
    rng = np.random.RandomState(seed)
    rows: list[tuple[int, int, int, int]] = []
    while True:
        before = len(rows)
        for doc in doc_range:
            first, last = int(document_indices[doc]), int(document_indices[doc + 1])
            if last - first < min_sentences or np.any(sizes[first:last] > LONG_SENTENCE):
                continue
            start, length, count = first, 0, 0
            target = target_length(rng, max_len, short_seq_prob)
            for s in range(first, last):
                length, count = length + int(sizes[s]), count + 1
                remaining = last - s - 1
                if (length >= target and remaining > 1 and count >= min_sentences) \
                        or remaining == 0:
                    rows.append((start, s + 1, target, doc))
                    start, length, count = s + 1, 0, 0
                    target = target_length(rng, max_len, short_seq_prob)
        if len(rows) == before:
            return np.zeros((0, 4), dtype=np.int64)
        if not num_samples or len(rows) >= num_samples:
            break
    mapping = np.asarray(rows, dtype=np.int64)
    rng.shuffle(mapping)
    return mapping


def truncate_segments(a: list, b: list, max_tokens: int, rng) -> bool:
    """Trim the longer segment, from a random end, until len(a) + len(b) <= max_tokens."""
    if len(a) + len(b) <= max_tokens:
        return False
    while len(a) + len(b) > max_tokens:
        seg = a if len(a) > len(b) else b
        del seg[0 if rng.random_sample() < 0.5 else -1]
    return True


def mask_tokens(tokens: list[int], special: set, vocab_ids: np.ndarray, mask_id: int,
                mask_prob: float, max_predictions: int, rng):
    """Megatron's masked-LM choice: returns (tokens, positions, labels)."""
    candidates = [i for i, t in enumerate(tokens) if t not in special]
    n = min(max_predictions, max(1, int(round(len(tokens) * mask_prob))), len(candidates))
    rng.shuffle(candidates)
    out, positions = list(tokens), sorted(candidates[:n])
    for i in positions:
        if rng.random_sample() < 0.8:
            out[i] = mask_id
        elif rng.random_sample() >= 0.5:
            out[i] = int(vocab_ids[rng.randint(0, len(vocab_ids))])
    return out, positions, [tokens[i] for i in positions]


class BertDataset:
    """dataset[i] -> dict of LongTensors, Megatron's sample with "text" named "tokens": tokens,
    types, labels (-1 where not predicted), loss_mask, padding_mask (1 = real token), is_random,
    truncated."""

    def __init__(self, indexed: MMapIndexedDataset, doc_range: range, tokenizer,
                 num_samples: int | None, seq_length: int, seed: int, cache_dir: str | Path,
                 short_seq_prob: float = 0.1, mask_prob: float = 0.15, binary_head: bool = True,
                 pair_task: str = "sop", split: str = "train",
                 builder: bool | None = None):
        if pair_task not in PAIR_TASKS:
            raise DataError(f"--sentence-pair-task {pair_task}: choose sop or nsp")
        if seq_length < 8:
            raise DataError(f"--seq-length {seq_length}: BERT samples need at least 8 tokens")
        check_probabilities(mask_prob, short_seq_prob)
        self.indexed, self.tokenizer = indexed, tokenizer
        self.seq_length, self.seed = seq_length, seed
        self.mask_prob, self.binary_head, self.pair_task = mask_prob, binary_head, pair_task
        self.cls, self.sep, self.mask_id, self.pad = (tokenizer.cls, tokenizer.sep,
                                                      tokenizer.mask, tokenizer.pad)
        self.special = set(getattr(tokenizer, "special_ids", ())) | {self.cls, self.sep}
        ids = np.arange(tokenizer.vocab_size)
        self.vocab_ids = ids[~np.isin(ids, list(self.special))]
        idx_path = index_file_path(indexed.prefix)
        stat = os.stat(idx_path)
        self.description = {
            "class": "BertDataset", "format": 1, "path": os.path.realpath(idx_path),
            "idx_bytes": stat.st_size, "idx_mtime_ns": stat.st_mtime_ns, "split": split,
            "documents": [doc_range.start, doc_range.stop], "num_samples": num_samples,
            "seq_length": seq_length, "seed": seed, "short_seq_prob": short_seq_prob,
            "min_sentences": 2 if binary_head else 1}
        arrays, self.built_indices = cached_arrays(
            Path(cache_dir), self.description, ("samples_mapping",),
            lambda: {"samples_mapping": build_sample_mapping(
                indexed.document_indices, indexed.sequence_lengths, doc_range, num_samples,
                seq_length - 3, short_seq_prob, seed, 2 if binary_head else 1)},
            builder=builder)
        self.samples_mapping = arrays["samples_mapping"]
        if num_samples and len(self.samples_mapping) == 0:
            raise DataError(f"{idx_path}: no BERT samples in the {split} split: documents need "
                            f"{2 if binary_head else 1}+ sentences of <= {LONG_SENTENCE} tokens "
                            "(preprocess with --split-sentences; check --split)")

    def __len__(self) -> int:
        return len(self.samples_mapping)

    def _sentences(self, row) -> list[np.ndarray]:
        return [self.indexed[s] for s in range(int(row[0]), int(row[1]))]

    def _segments(self, idx: int, sentences: list, rng) -> tuple[list, list, bool]:
        if not self.binary_head:
            return [t for s in sentences for t in s.tolist()], [], False
        a_end = int(rng.randint(1, len(sentences))) if len(sentences) >= 3 else 1
        a = [t for s in sentences[:a_end] for t in s.tolist()]
        b = [t for s in sentences[a_end:] for t in s.tolist()]
        if rng.random_sample() >= 0.5:
            return a, b, False
        if self.pair_task == "sop":
            return b, a, True
        doc = self.samples_mapping[idx][3]
        for _ in range(10):  # B from another document (NSP)
            other = self.samples_mapping[rng.randint(0, len(self))]
            if other[3] != doc:
                return a, [t for s in self._sentences(other) for t in s.tolist()], True
        return a, b, False  # a one-document split: no random pair possible

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range: the dataset has {len(self)} samples")
        row = self.samples_mapping[idx]
        rng = np.random.RandomState((self.seed + int(idx)) % 2 ** 32)
        a, b, is_random = self._segments(int(idx), self._sentences(row), rng)
        max_tokens = int(row[2])
        truncated = truncate_segments(a, b, max_tokens, rng)
        tokens = [self.cls] + a + [self.sep] + (b + [self.sep] if b else [])
        types = [0] * (len(a) + 2) + ([1] * (len(b) + 1) if b else [])
        max_predictions = max(1, int(self.mask_prob * max_tokens))
        tokens, positions, targets = mask_tokens(tokens, self.special, self.vocab_ids,
                                                 self.mask_id, self.mask_prob, max_predictions, rng)
        n, pad = len(tokens), self.seq_length - len(tokens)
        labels = np.full(self.seq_length, -1, dtype=np.int64)
        labels[positions] = targets
        loss_mask = np.zeros(self.seq_length, dtype=np.int64)
        loss_mask[positions] = 1
        return {"tokens": torch.tensor(tokens + [self.pad] * pad, dtype=torch.long),
                "types": torch.tensor(types + [0] * pad, dtype=torch.long),
                "labels": torch.from_numpy(labels), "loss_mask": torch.from_numpy(loss_mask),
                "padding_mask": torch.tensor([1] * n + [0] * pad, dtype=torch.long),
                "is_random": torch.tensor(int(is_random), dtype=torch.long),
                "truncated": torch.tensor(int(truncated), dtype=torch.long)}
