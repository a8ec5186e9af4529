"""The data entry points of the pretrain scripts: flags -> (dataset, padded vocab size, tokenizer).

    tokenizer, vocab_size = pretrain_tokenizer(args, "gpt")   # first: the config needs the vocab
    data = build_pretrain_data(args, "gpt", seq_length, seed, train_samples, valid_samples,
                               tokenizer=tokenizer)                # data.vocab_size == vocab_size
    batches = GPTBatches(data.train, micro_batch_size, m, w, dp_rank)   # BertBatches for bert

`--mock-data` -> MockGPTDataset; `--data-path` -> indexed datasets (blended by weight), split by
`--split`, tokenizer from `--tokenizer-type/--tokenizer-model` (or --vocab-size for the
NullTokenizer); neither -> the embedded default corpus (default_corpus.py). Everything is
built once per node (data/cache.py, no locks) and cached, so every rank may call this before
any process group exists. The checks that read a whole .bin or .idx run once per file version
(consistency.py). A rank that reads no data (`reads=False`: a middle pipeline stage, which
receives activations) opens no .bin and reads only each .idx's header, to size the splits as
the data ranks do (so it takes part in evaluation exactly when they do); its datasets are
`NO_DATA`. `builder`: whether this rank builds its node's caches (default: local rank 0; the
pretrain script passes the node's first rank that reads data).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from megatron_2bw.data.bert_dataset import BertDataset, check_probabilities
from megatron_2bw.data.blended_dataset import BlendedDataset, blend_split, parse_data_path
from megatron_2bw.data.cache import writable_dir
from megatron_2bw.data.consistency import check_dataset, open_dataset, split_counts
from megatron_2bw.data.default_corpus import default_corpus
from megatron_2bw.data.errors import DataError
from megatron_2bw.data.gpt_dataset import SPLIT_NAMES, GPTDataset, parse_split, split_indices
from megatron_2bw.data.indexed_dataset import MMapIndexedDataset
from megatron_2bw.data.mock import MockGPTDataset
from megatron_2bw.data.tokenizer import (SENTENCEPIECE_TYPES, Tokenizer, build_tokenizer,
                                         tokenizer_from_args, tokenizer_type_of,
                                         vocab_size_with_padding)
from megatron_2bw.fs import user_cache_dir


DEFAULT_SPLIT = "969, 30, 1"


class TrainData(NamedTuple):
    dataset: Any             # __len__, __getitem__(i); GPT: LongTensor[seq_length + 1]
    vocab_size: int          # padded (Megatron's --make-vocab-size-divisible-by)
    tokenizer: Tokenizer | None


class PretrainData(NamedTuple):
    train: Any
    valid: Any | None        # the --split validation part (None: not asked for / empty)
    vocab_size: int
    tokenizer: Tokenizer | None


def index_cache_dir(prefix: str, data_cache_path: str | None, kind: str) -> Path:
    """--data-cache-path, else PREFIX's dir/cache/{kind}_indices, else the user cache."""
    if data_cache_path:
        return writable_dir(Path(data_cache_path), Path(data_cache_path))
    beside = Path(os.path.dirname(os.path.abspath(prefix))) / "cache" / f"{kind}_indices"
    return writable_dir(beside, user_cache_dir() / "indices" / f"{kind}_indices")


def _split_ranges(num_documents: int, split: str) -> list[range]:
    b = split_indices(parse_split(split), num_documents)
    return [range(b[i], b[i + 1]) for i in range(3)]


class NoData:
    """The dataset of a rank that reads no data (a middle pipeline stage); never read."""

    def __getitem__(self, i):
        raise DataError(f"sample {i} asked of a rank that reads no data (a middle pipeline "
                        "stage): only the first and last stage read batches")

    def __repr__(self) -> str:
        return "NO_DATA"


NO_DATA = NoData()


def _of_flag(flag: str, prefix: str, read, *args):
    """read(*args); a DataError about the prefix's files ends naming the flag that gave it."""
    try:
        return read(*args)
    except DataError as e:
        raise DataError(f"{e} ({flag} {prefix})") from None


def open_checked(data_path, tokenizer, data_cache_path: str | None = None,
                 builder: bool | None = None, flag: str = "--data-path") -> list:
    """The --data-path prefixes' indexed datasets, each whole (the .idx checks and the .bin's id
    range run once per file version, cached), non-empty and within the tokenizer's vocabulary
    (consistency.check_dataset); one-line DataError otherwise, naming `flag` (the flag the
    prefixes came from)."""
    prefixes, _ = parse_data_path(data_path, flag)
    indexed = []
    for p in prefixes:
        where = index_cache_dir(p, data_cache_path, "DataCheck")
        indexed.append(_of_flag(flag, p, open_dataset, p, where, builder))
        check_dataset(indexed[-1], tokenizer, where, builder)
    return indexed


def build_gpt_datasets(data_path, split: str, seq_length: int, seed: int,
                       num_samples: tuple, data_cache_path: str | None = None,
                       indexed: list | None = None, builder: bool | None = None,
                       flag: str = "--data-path") -> list:
    """[train, valid, test] GPT datasets (None for an empty split) of num_samples[i] samples
    each (None: one epoch). Several prefixes are blended as megatron-core blends them (by weight,
    default: by their number of samples; blended_dataset.blend_split).
    `indexed`: the prefixes' datasets when already open (open_checked)."""
    prefixes, weights = parse_data_path(data_path, flag)
    indexed = indexed or [MMapIndexedDataset(p) for p in prefixes]
    ranges = [_split_ranges(len(ds), split) for ds in indexed]
    out = []
    for s, name in enumerate(SPLIT_NAMES):
        n = num_samples[s]
        if all(len(r[s]) == 0 for r in ranges) or n == 0:
            out.append(None)
            continue

        def part(i, count):
            return GPTDataset(indexed[i], np.arange(ranges[i][s].start, ranges[i][s].stop),
                              count, seq_length, seed,
                              index_cache_dir(prefixes[i], data_cache_path, "GPTDataset"), name,
                              builder=builder)
        if len(prefixes) == 1 and weights is None:  # `--data-path 1 A` blends, as Megatron
            out.append(part(0, n))
            continue
        empty = [p for p, r in zip(prefixes, ranges) if len(r[s]) == 0]
        if empty:
            raise _empty_part(empty[0], name, split, flag)
        parts, w, size = blend_split(part, len(prefixes), weights, n)  # Megatron's sizes
        out.append(BlendedDataset(parts, w, size, index_cache_dir(prefixes[0], data_cache_path,
                                                                  "BlendedDataset"), builder))
    return out


def _get(args, name, default=None):
    value = getattr(args, name, default)
    return default if value is None else value


def _num_samples(args, num_samples):
    if num_samples is not None:
        return num_samples
    iters, gbs = getattr(args, "train_iters", None), getattr(args, "global_batch_size", None)
    return iters * gbs if iters and gbs else None


_DEFAULTS = {"gpt": ("GPTSentencePieceTokenizer", "document_prefix"),
             "bert": ("SentencePieceTokenizer", "sentence_prefix")}  # tokenizer, corpus prefix


def _tokenizer_and_data(args, family: str, tokenizer: Tokenizer | None = None):
    """(tokenizer, --data-path items) from the flags, or the default corpus's when no
    --data-path is given. `tokenizer`: the one `pretrain_tokenizer` already built."""
    default_type, default_prefix_attr = _DEFAULTS[family]
    data_path, ttype = _get(args, "data_path"), tokenizer_type_of(args)
    model, per_split = _get(args, "tokenizer_model"), per_split_paths(args)
    if not data_path and not per_split:
        if model or _get(args, "vocab_file") or ttype not in (None, default_type):
            raise DataError("--tokenizer-type/--tokenizer-model/--vocab-file need --data-path: "
                            "without it the embedded default corpus is used with its own "
                            "tokenizer")
        corpus = default_corpus()
        return (tokenizer or build_tokenizer(default_type, corpus.tokenizer_model),
                [getattr(corpus, default_prefix_attr)])
    ttype = ttype or default_type
    if ttype in SENTENCEPIECE_TYPES and not model:
        raise DataError("--data-path needs --tokenizer-model FILE.model (the sentencepiece "
                        "model the data was preprocessed with), another --tokenizer-type with "
                        "its files, or --tokenizer-type NullTokenizer --vocab-size N")
    return tokenizer or tokenizer_from_args(args, ttype), list(data_path) if data_path else None


def pretrain_tokenizer(args, family: str = "gpt") -> tuple[Tokenizer | None, int]:
    """(tokenizer, padded vocabulary size) of pretrain_{family}.py's flags, without reading any
    data: the config needs the vocabulary before it is validated. --mock-data: (None,
    --vocab-size). Pass the tokenizer on to `build_pretrain_data`."""
    if family not in _DEFAULTS:
        raise DataError(f"unknown model family {family!r}: gpt or bert")
    if _get(args, "mock_data", False):  # a named tokenizer sizes the vocabulary, as Megatron's
        if tokenizer_type_of(args) in (None, "NullTokenizer"):
            return None, _get(args, "vocab_size", 512)
        tokenizer = tokenizer_from_args(args)
        return tokenizer, _padded_vocab(args, tokenizer)
    tokenizer, _ = _tokenizer_and_data(args, family)
    return tokenizer, _padded_vocab(args, tokenizer)


def _padded_vocab(args, tokenizer) -> int:
    return vocab_size_with_padding(tokenizer.vocab_size,
                                   _get(args, "make_vocab_size_divisible_by", 128),
                                   _get(args, "tensor_model_parallel_size", 1))


def _bert_datasets(args, tokenizer, data_path, seq_length, seed, samples, indexed,
                   builder=None, split: str = DEFAULT_SPLIT) -> list:
    prefixes, _ = parse_data_path(data_path)
    indexed = indexed[0]
    ranges = _split_ranges(len(indexed.document_indices) - 1, split)
    out = []
    for r, n, name in zip(ranges, samples, SPLIT_NAMES):
        out.append(None if len(r) == 0 or n == 0 else BertDataset(
            indexed, r, tokenizer, n, seq_length, seed,
            index_cache_dir(prefixes[0], _get(args, "data_cache_path"), "BertDataset"),
            short_seq_prob=_get(args, "short_seq_prob", 0.1),
            mask_prob=_get(args, "mask_prob", 0.15),
            binary_head=not _get(args, "bert_no_binary_head", False),
            pair_task=_get(args, "sentence_pair_task", "sop"), split=name, builder=builder))
    return out


def _mock(args, family: str, vocab: int, seq_length: int, seed: int):
    if family == "bert":
        from megatron_2bw.data.bert_mock import MockBertDataset
        return MockBertDataset(vocab, seq_length, seed=seed,
                               mask_prob=_get(args, "mask_prob", 0.15),
                               short_seq_prob=_get(args, "short_seq_prob", 0.1))
    return MockGPTDataset(vocab, seq_length, seed=seed)


def build_pretrain_data(args, family: str = "gpt", seq_length: int | None = None,
                        seed: int | None = None, train_samples: int | None = None,
                        valid_samples: int = 0, tokenizer: Tokenizer | None = None,
                        reads: bool = True, builder: bool | None = None) -> PretrainData:
    """Train (and, when valid_samples > 0, validation) datasets for pretrain_{family}.py.

    train_samples defaults to --train-iters x --global-batch-size (one epoch when unknown);
    Megatron's valid_samples is (train_iters // eval_interval + 1) x eval_iters x global batch.
    valid is None when not asked for or when --split gives it no documents. `tokenizer`: the one
    `pretrain_tokenizer` built (else it is built here). `reads`, `builder`: the module doc."""
    if family not in _DEFAULTS:
        raise DataError(f"unknown model family {family!r}: gpt or bert")
    seq_length = seq_length or _get(args, "seq_length")
    seed = _get(args, "seed", 1234) if seed is None else seed
    if family == "bert":  # flags the mock data does not use are still checked
        check_probabilities(_get(args, "mask_prob", 0.15), _get(args, "short_seq_prob", 0.1))
    if _get(args, "mock_data", False):
        per_split_paths(args)  # refused with --mock-data
        if _get(args, "data_path"):
            raise DataError("--mock-data and --data-path are exclusive: pass one of them")
        vocab = tokenizer.vocab_size if tokenizer else _get(args, "vocab_size", 512)
        return PretrainData(_mock(args, family, vocab, seq_length, seed),
                            _mock(args, family, vocab, seq_length, seed + 1)
                            if valid_samples else None,
                            _padded_vocab(args, tokenizer) if tokenizer else vocab, tokenizer)
    tokenizer, data_path = _tokenizer_and_data(args, family, tokenizer)
    samples = (_num_samples(args, train_samples), valid_samples, 0)
    per_split = per_split_paths(args)
    if per_split is None:
        train, valid = _indexed(args, family, tokenizer, data_path,
                                _get(args, "split", DEFAULT_SPLIT), seq_length, seed, samples,
                                reads, builder)
    else:  # each split all of its own data (Megatron's blend per split)
        train = _indexed(args, family, tokenizer, per_split[0], "1,0,0", seq_length, seed,
                         (samples[0], 0, 0), reads, builder, "--train-data-path")[0]
        valid = _indexed(args, family, tokenizer, per_split[1], "0,1,0", seq_length, seed,
                         (0, samples[1], 0), reads, builder, "--valid-data-path",
                         need_train=False)[1] if per_split[1] and samples[1] else None
        for path, flag in ((per_split[1] if not samples[1] else None, "--valid-data-path"),
                           (per_split[2], "--test-data-path")):
            if path and reads:  # checked as the data are: no evaluation of them in this run
                open_checked(path, tokenizer, _get(args, "data_cache_path"), builder, flag)
    return PretrainData(train, valid, _padded_vocab(args, tokenizer), tokenizer)


SPLIT_FLAGS = ("train-data-path", "valid-data-path", "test-data-path")


def per_split_paths(args) -> list | None:
    """[train, valid, test] of --train-data-path/--valid-data-path/--test-data-path (each a
    --data-path list, or None), None when none is given; one-line DataError for what Megatron
    refuses with them: --data-path, --mock-data, a --split, no --train-data-path."""
    paths = [_get(args, name.replace("-", "_")) or None for name in SPLIT_FLAGS]
    if not any(paths):
        return None
    given = " / ".join(f"--{f}" for f, x in zip(SPLIT_FLAGS, paths) if x)
    if _get(args, "data_path") or _get(args, "mock_data", False):
        raise DataError(f"{given} with --{'data-path' if _get(args, 'data_path') else 'mock-data'}"
                        ": give one data source (--data-path divided by --split, or one path "
                        "per split)")
    if paths[0] is None:
        raise DataError(f"{given} without --train-data-path: give the training data too")
    if _get(args, "split", DEFAULT_SPLIT) != DEFAULT_SPLIT:
        raise DataError(f"--split {_get(args, 'split')} with {given}: each split reads all of "
                        "its own data; drop --split")
    return paths


def _indexed(args, family, tokenizer, data_path, split, seq_length, seed, samples, reads,
             builder, flag: str = "--data-path", need_train: bool = True) -> tuple:
    """(train, valid) of `data_path` divided by `split` (None where a split is not asked for or
    empty; an empty train split is an error when `need_train`)."""
    cache, prefixes = _get(args, "data_cache_path"), parse_data_path(data_path, flag)[0]
    if family == "bert" and len(prefixes) != 1:
        raise DataError(f"{flag}: BERT takes one prefix (blending is GPT-only for now)")
    if not reads:
        train, valid = _no_data(family, prefixes, split, samples, flag)
        if train is None and need_train:
            raise _empty_train_split(split, {p: split_counts(p)[1] for p in prefixes})
        return train, valid
    indexed = open_checked(data_path, tokenizer, cache, builder, flag)
    if family == "gpt":
        train, valid, _ = build_gpt_datasets(data_path, split, seq_length, seed, samples, cache,
                                             indexed, builder, flag)
    else:
        train, valid, _ = _bert_datasets(args, tokenizer, data_path, seq_length, seed, samples,
                                         indexed, builder, split)
    if train is None and need_train:
        raise _empty_train_split(split, {p: len(ds.document_indices) - 1
                                         for p, ds in zip(prefixes, indexed)})
    unweighted_blend = parse_data_path(data_path, flag)[1] is None and len(prefixes) > 1
    for ds, need, what in ((train, samples[0], "training"), (valid, samples[1], "evaluation")):
        if unweighted_blend and ds is not None and need and len(ds) < need:  # one epoch
            raise DataError(f"{flag} {' '.join(map(str, data_path))}: an unweighted blend "
                            f"is one epoch of its prefixes, {len(ds)} samples, but {what} "
                            f"needs {need}: give weights (e.g. {flag} 0.5 A 0.5 B) to "
                            "repeat the data, or fewer iterations")
    return train, valid


def _no_data(family: str, prefixes: list, split: str, samples: tuple,
             flag: str = "--data-path") -> tuple:
    """(train, valid) of a rank that reads no data: NO_DATA where the data ranks get a dataset,
    None where they get none (the same split arithmetic on the counts in the .idx headers: GPT
    splits sequences of each prefix, BERT the documents of its one prefix)."""
    counts = [_of_flag(flag, p, split_counts, p) for p in prefixes]
    out = []
    for s in range(2):
        sizes = [n for n, _ in counts] if family == "gpt" else [counts[0][1]]
        empty = [p for p, n in zip(prefixes, sizes) if len(_split_ranges(n, split)[s]) == 0]
        if len(empty) == len(sizes) or samples[s] == 0:
            out.append(None)
            continue
        if empty:  # a blend with a prefix that has none of this split
            raise _empty_part(empty[0], SPLIT_NAMES[s], split, flag)
        out.append(NO_DATA)
    return tuple(out)


def _empty_part(prefix: str, name: str, split: str, flag: str = "--data-path") -> DataError:
    if flag != "--data-path":  # a per-split blend reads all of each prefix: it is empty
        return DataError(f"{flag}: {prefix} has no documents while the other prefixes do: give "
                         "it documents or drop it")
    return DataError(f"--data-path: {prefix} has no documents in the {name} split (--split "
                     f"{split}) while the other prefixes do: give it more documents or change "
                     "--split")


def _empty_train_split(split: str, docs: dict) -> DataError:
    """Why the train split got no documents: its --split weight is 0, or too few documents
    (`docs`: prefix -> its document count)."""
    if parse_split(split)[0] == 0:
        return DataError(f"--split {split}: the train split has weight 0: give it a positive "
                         "weight, e.g. --split 969,30,1")
    listed = ", ".join(f"{p} has {n}" for p, n in docs.items())
    return DataError(f"--split {split}: the train split rounds to 0 documents ({listed}): add "
                     "documents or raise the train weight")


def build_gpt_train_data(args, seq_length: int | None = None, seed: int | None = None,
                         num_samples: int | None = None) -> TrainData:
    """(GPT train dataset, padded vocab size, tokenizer) for the flags; see the module doc."""
    d = build_pretrain_data(args, "gpt", seq_length, seed, num_samples)
    return TrainData(d.train, d.vocab_size, d.tokenizer)


def build_bert_train_data(args, seq_length: int | None = None, seed: int | None = None,
                          num_samples: int | None = None) -> TrainData:
    """(BERT train dataset, padded vocab size, tokenizer): a `_sentence` indexed dataset (or
    the default corpus's) with a tokenizer that has [CLS]/[SEP]/[MASK]/pad. One prefix."""
    d = build_pretrain_data(args, "bert", seq_length, seed, num_samples)
    return TrainData(d.train, d.vocab_size, d.tokenizer)
