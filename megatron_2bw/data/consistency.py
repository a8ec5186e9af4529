"""Data against tokenizer, checked before any process group: every token id fits the vocabulary.

Training on data preprocessed with another tokenizer fails (or silently learns garbage) deep in a
step: an id >= the embedding's rows is an IndexError on one rank and "Connection reset by peer"
on the others. `check_data_fits_tokenizer` turns that into one line at start-up, per --data-path
prefix:

- the dataset has documents and tokens (an empty dataset is named as such, not as a --split
  problem);
- its token dtype is an integer type that can hold the tokenizer's ids (uint8 data for a
  2000-id tokenizer was written for another tokenizer, or its dtype code is wrong);
- its smallest and largest token id lie in [0, tokenizer.vocab_size).

The checks that read a whole file run once per file version and are cached like the sample
indices (`cached_arrays`, keyed by the .bin/.idx paths, sizes and mtimes): the index's
self-consistency (indexed_dataset.IndexReader: lengths, pointers, document indices) and the
.bin's id range. The node's builder runs them (and keeps a failure's message, so every rank
raises the same line); later runs and the other ranks read a few numbers and open the files
without re-reading them (`open_dataset`). A rank that reads no data (a middle pipeline stage)
needs only the split sizes: `split_counts` reads the 34-byte .idx header and nothing else.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from megatron_2bw.data.cache import cached_arrays
from megatron_2bw.data.errors import DataError
from megatron_2bw.data.indexed_dataset import (MMapIndexedDataset, data_file_path, index_file_path,
                                               index_header)

CHECK_FORMAT = 2
_CHUNK = 1 << 24  # tokens per numpy pass


def scan_token_range(indexed: MMapIndexedDataset) -> np.ndarray:
    """[smallest, largest] token id of the whole .bin (int64; [0, -1] when it has no tokens)."""
    tokens = indexed.tokens()
    lo, hi = None, None
    for start in range(0, len(tokens), _CHUNK):
        chunk = tokens[start:start + _CHUNK]
        c_lo, c_hi = int(chunk.min()), int(chunk.max())
        lo = c_lo if lo is None else min(lo, c_lo)
        hi = c_hi if hi is None else max(hi, c_hi)
    return np.array([0, -1] if lo is None else [lo, hi], dtype=np.int64)


def _full_check(prefix: str) -> dict[str, np.ndarray]:
    """Open the dataset with every check of the whole .idx, scan the .bin's ids: the verdict
    ("problem": a DataError's message as UTF-8, empty when whole; "tokens"; "token_range")."""
    try:
        indexed = MMapIndexedDataset(prefix)
    except DataError as e:
        return {"problem": np.frombuffer(str(e).encode(), np.uint8),
                "tokens": np.zeros(1, np.int64), "token_range": np.array([0, -1], np.int64)}
    return {"problem": np.zeros(0, np.uint8), "tokens": np.array([indexed.num_tokens], np.int64),
            "token_range": scan_token_range(indexed)}


def _verdict(prefix: str, cache_dir: str | Path, builder: bool | None = None) -> dict:
    """The cached verdict of `_full_check` for this version of PREFIX.bin/.idx."""
    description = {"class": "DataCheck", "format": CHECK_FORMAT}
    for kind, path in (("idx", index_file_path(prefix)), ("bin", data_file_path(prefix))):
        if not os.path.isfile(path):  # named as the dataset reader names it
            MMapIndexedDataset(prefix)
        stat = os.stat(path)
        description.update({f"{kind}_path": os.path.realpath(path), f"{kind}_bytes": stat.st_size,
                            f"{kind}_mtime_ns": stat.st_mtime_ns})
    arrays, _ = cached_arrays(Path(cache_dir), description, ("problem", "tokens", "token_range"),
                              lambda: _full_check(prefix), builder=builder)
    problem = bytes(arrays["problem"]).decode()
    if problem:
        raise DataError(problem)
    return arrays


def open_dataset(prefix: str, cache_dir: str | Path, builder: bool | None = None
                 ) -> MMapIndexedDataset:
    """PREFIX's indexed dataset, its whole-file checks run once per file version (cached in
    cache_dir; `builder`: default local rank 0); one-line DataError when it is not whole."""
    tokens = int(_verdict(prefix, cache_dir, builder)["tokens"][0])
    return MMapIndexedDataset(prefix, checked_tokens=tokens)


def token_range(indexed: MMapIndexedDataset, cache_dir: str | Path,
                builder: bool | None = None) -> tuple[int, int]:
    """(smallest, largest) token id, scanned once per file version and cached in cache_dir."""
    lo, hi = (int(x) for x in _verdict(indexed.prefix, cache_dir, builder)["token_range"])
    return lo, hi


def split_counts(prefix: str) -> tuple[int, int]:
    """(sequences, documents) of PREFIX from its .idx header alone: what a rank that reads no
    data needs to size the splits as the ranks that read it do."""
    _, sequences, document_indices, _ = index_header(index_file_path(prefix))
    return sequences, max(document_indices - 1, 0)


def _tokenizer_words(tokenizer, largest: int) -> tuple[str, str]:
    """(how to name the tokenizer, how to fix a mismatch) for the error line."""
    model = getattr(tokenizer, "model_file", None) or getattr(tokenizer, "source", None)
    if model is None:  # the NullTokenizer: ids 0 .. --vocab-size, eod is the last
        return (f"NullTokenizer (--vocab-size {tokenizer.vocab_size - 1})",
                f"pass --vocab-size {max(largest, 1)} or more (the size it was preprocessed "
                "with)")
    files = "--tokenizer-model" if getattr(tokenizer, "model_file", None) else "tokenizer files"
    return (f"{tokenizer.name} {model}",
            f"pass the {files} the data was preprocessed with (or re-run "
            "tools/preprocess_data.py with this one)")


def check_dataset(indexed: MMapIndexedDataset, tokenizer, cache_dir: str | Path,
                  builder: bool | None = None) -> None:
    """One-line DataError unless the dataset is non-empty and its ids fit the tokenizer."""
    idx, bin_path = index_file_path(indexed.prefix), data_file_path(indexed.prefix)
    documents = len(indexed.document_indices) - 1
    if documents == 0:
        raise DataError(f"{idx}: no documents (an empty dataset): preprocess a non-empty "
                        "--input with tools/preprocess_data.py")
    if indexed.num_tokens == 0:
        raise DataError(f"{idx}: {documents} documents but no tokens (every document is "
                        "empty): preprocess an --input with text under its --json-keys")
    vocab, dtype = tokenizer.vocab_size, indexed.dtype
    if dtype.kind not in "iu":
        raise DataError(f"{idx}: token dtype {dtype} is not an integer type: the dtype code "
                        "is wrong or this is not token data; regenerate it with "
                        "tools/preprocess_data.py")
    if np.iinfo(dtype).max < vocab - 1:
        name, _ = _tokenizer_words(tokenizer, 0)
        raise DataError(f"{idx}: token dtype {dtype} holds ids up to {np.iinfo(dtype).max} but "
                        f"the {name} has {vocab}: the data was written for another tokenizer "
                        "or its dtype code is wrong; regenerate it with "
                        "tools/preprocess_data.py and this tokenizer")
    lo, hi = token_range(indexed, cache_dir, builder)
    if lo < 0 or hi >= vocab:
        name, fix = _tokenizer_words(tokenizer, hi)
        bad = f"go down to {lo}" if lo < 0 else f"go up to {hi}"
        raise DataError(f"{bin_path}: token ids {bad} but the {name} has {vocab} ids (0-"
                        f"{vocab - 1}): the data was preprocessed with another tokenizer; {fix}")
