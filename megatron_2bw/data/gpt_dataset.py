"""Megatron's GPT dataset over an indexed dataset: fixed-length samples spanning documents.

Three indices, built once per (data, split, samples, seq_length, seed) and cached:

- document index: the split's document ids repeated for enough epochs, shuffled by the seed
  (when the last epoch is needed only for less than 80% of it, it is shuffled separately so
  that the first epochs are not diluted, as Megatron does);
- sample index: row k = (position in the document index, token offset) where sample k starts;
  sample k is the seq_length + 1 tokens from row k to row k+1 inclusive (consecutive samples
  share one token, the last label / first input);
- shuffle index: a seeded permutation of the samples.

`dataset[i]` is a LongTensor[seq_length + 1]; it depends only on i and the parameters, so a run
resumes at any sample index (GPTBatches(start_batch=...)) with exactly the samples it would
have seen.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from megatron_2bw.config.numbers import is_finite
from megatron_2bw.data.cache import cached_arrays
from megatron_2bw.data.errors import DataError
from megatron_2bw.data.indexed_dataset import MMapIndexedDataset, index_file_path

INDEX_FORMAT = 1  # bump when the index semantics change
SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split: str) -> list[float]:
    """'969,30,1' (or '98/2/0', or '1') -> three normalized weights (train, valid, test)."""
    try:
        parts = [float(s) for s in str(split).replace("/", ",").split(",") if s.strip()]
    except ValueError:
        parts = []
    if not parts or len(parts) > 3 or not all(is_finite(p) and p >= 0 for p in parts) \
            or sum(parts) <= 0:
        raise DataError(f"--split {split!r}: give up to three non-negative weights for "
                        "train,valid,test, e.g. --split 969,30,1")
    parts += [0.0] * (3 - len(parts))
    return [p / sum(parts) for p in parts]


def split_indices(weights: list[float], num_elements: int) -> list[int]:
    """megatron-core's document boundaries of the splits, [0, a, b, num_elements]: split k is
    [round(c_k x n), round(c_k+1 x n)) with c_k the running sum of the normalized weights
    (BlendedMegatronDatasetConfig's split matrix; Python's round, halves to even)."""
    bounds, total = [0], 0.0
    for w in weights:
        total = total + w
        bounds.append(int(round(total * float(num_elements))))
    return bounds


def build_document_index(documents: np.ndarray, num_epochs: int, rng: np.random.RandomState,
                         separate_final_epoch: bool) -> np.ndarray:
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray,
                       seq_length: int) -> np.ndarray:
    """[num_samples + 1, 2] (document-index position, offset) of each sample start, where
    sample k starts at token k * seq_length of the concatenated documents; the last partial
    sample is dropped (Megatron's helpers.build_sample_idx, vectorized)."""
    doc_sizes = sizes[document_index].astype(np.int64)
    ends = np.cumsum(doc_sizes)
    total = int(ends[-1]) if len(ends) else 0
    num_samples = max(total - 1, 0) // seq_length
    starts = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    pos = np.searchsorted(ends, starts, side="right")
    offsets = starts - (ends[pos] - doc_sizes[pos]) if len(ends) else starts
    index = np.stack([pos, offsets], axis=1)
    index[0] = 0
    return index


def build_shuffle_index(num_samples: int, total_size: int,
                        rng: np.random.RandomState) -> np.ndarray:
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


class GPTDataset:
    """Samples of seq_length + 1 tokens from `documents` (sequence ids) of an indexed dataset."""

    def __init__(self, indexed: MMapIndexedDataset, documents: np.ndarray, num_samples: int | None,
                 seq_length: int, seed: int, cache_dir: str | Path, split: str = "train",
                 builder: bool | None = None):
        self.indexed, self.seq_length, self.seed = indexed, seq_length, seed
        self.documents = np.asarray(documents, dtype=np.int64)
        sizes = indexed.sequence_lengths
        self.tokens_per_epoch = int(sizes[self.documents].sum(dtype=np.int64))
        if num_samples and self.tokens_per_epoch <= 1:
            raise DataError(f"{index_file_path(indexed.prefix)}: the {split} split has "
                            f"{self.tokens_per_epoch} tokens, too few for any sample: give it "
                            "more documents (check --split) or more data")
        idx_path = index_file_path(indexed.prefix)
        stat = os.stat(idx_path)
        self.description = {
            "class": "GPTDataset", "format": INDEX_FORMAT, "path": os.path.realpath(idx_path),
            "idx_bytes": stat.st_size, "idx_mtime_ns": stat.st_mtime_ns, "split": split,
            "documents": [int(self.documents[0]), int(self.documents[-1]) + 1]
            if len(self.documents) else [0, 0],
            "num_samples": num_samples, "seq_length": seq_length, "seed": seed}
        arrays, self.built_indices = cached_arrays(
            Path(cache_dir), self.description, ("document_index", "sample_index", "shuffle_index"),
            lambda: self._build(num_samples), builder=builder)
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def _num_epochs(self, num_samples: int | None) -> int:
        if not num_samples:
            return 1
        needed = num_samples * self.seq_length + 1
        return max(1, -(-needed // self.tokens_per_epoch))

    def _build(self, num_samples: int | None) -> dict[str, np.ndarray]:
        num_epochs = self._num_epochs(num_samples)
        separate_final_epoch, sans_final = False, 0
        if num_epochs > 1:
            sans_final = ((num_epochs - 1) * self.tokens_per_epoch - 1) // self.seq_length
            per_epoch = (self.tokens_per_epoch - 1) // self.seq_length
            separate_final_epoch = num_samples - sans_final < int(0.80 * per_epoch)
        rng = np.random.RandomState(self.seed)
        document_index = build_document_index(self.documents, num_epochs, rng,
                                              separate_final_epoch)
        sample_index = build_sample_index(self.indexed.sequence_lengths, document_index,
                                          self.seq_length)
        total = sample_index.shape[0] - 1
        shuffle_index = build_shuffle_index(sans_final if separate_final_epoch else total,
                                            total, rng)
        return {"document_index": document_index, "sample_index": sample_index,
                "shuffle_index": shuffle_index}

    def __len__(self) -> int:
        return self.shuffle_index.shape[0]

    def sample_tokens(self, idx: int) -> np.ndarray:
        """The seq_length + 1 token ids of sample idx (numpy, the file's dtype)."""
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range: the dataset has {len(self)} samples")
        i = int(self.shuffle_index[idx])
        (b, b_off), (e, e_off) = self.sample_index[i], self.sample_index[i + 1]
        get, docs = self.indexed.get, self.document_index
        if b == e:
            return get(int(docs[b]), int(b_off), int(e_off - b_off + 1))
        parts = [get(int(docs[b]), int(b_off))]
        parts += [get(int(docs[k])) for k in range(b + 1, e)]
        parts.append(get(int(docs[e]), 0, int(e_off + 1)))
        return np.concatenate(parts)

    def __getitem__(self, idx: int) -> torch.Tensor:
        return torch.from_numpy(self.sample_tokens(int(idx)).astype(np.int64))
