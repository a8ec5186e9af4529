"""The embedded default corpus: Python's language-reference help topics, no download ever.

Every Python install ships `pydoc_data.topics` (about 0.5 MB of English and code). The first use
trains a small sentencepiece model on it and writes two indexed datasets into the cache
(`$MEGATRON_2BW_CACHE` or ~/.cache/megatron_2bw, under default_corpus/):

    tokenizer.model          sentencepiece (bpe, DEFAULT_VOCAB_SIZE pieces; eos is GPT's eod)
    topics_text_document.*   one document per topic + eod        (GPTSentencePieceTokenizer)
    topics_text_sentence.*   one sequence per sentence, no eod    (SentencePieceTokenizer, BERT)

It takes about a second. Local rank 0 builds it (no process group needed, no file lock) in a
temporary directory renamed into place, so nobody ever reads a half-written file; the other
ranks of the node wait for the directory (data/cache.py). Two builders (one per node on a shared
filesystem) are harmless: the first rename wins and the other discards its copy. The directory name hashes the text, the vocab
size and the sentencepiece version, so a different Python gets its own corpus.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import NamedTuple

import numpy as np

from megatron_2bw.data.cache import is_local_builder, wait_until
from megatron_2bw.data.errors import DataError
from megatron_2bw.data.indexed_dataset import MMapIndexedDataset
from megatron_2bw.data.preprocess import write_documents
from megatron_2bw.data.tokenizer import (GPTSentencePieceTokenizer, SentencePieceTokenizer,
                                         train_sentencepiece)
from megatron_2bw.fs import atomic_build_dir, user_cache_dir

CORPUS_VERSION = 1
DEFAULT_VOCAB_SIZE = 2000
MODEL_TYPE = "bpe"


class DefaultCorpus(NamedTuple):
    directory: Path
    tokenizer_model: str     # for --tokenizer-model
    document_prefix: str     # GPT: --data-path prefix
    sentence_prefix: str     # BERT: --data-path prefix


def corpus_documents() -> list[str]:
    """The help topics, one document each, in a fixed (sorted) order."""
    from pydoc_data.topics import topics
    return [topics[k].strip() for k in sorted(topics) if topics[k].strip()]


def _corpus_dir(root: Path, vocab_size: int) -> Path:
    import sentencepiece
    h = hashlib.md5()
    for doc in corpus_documents():
        h.update(doc.encode())
    h.update(f"{CORPUS_VERSION}-{vocab_size}-{MODEL_TYPE}-{sentencepiece.__version__}".encode())
    return root / "default_corpus" / f"v{CORPUS_VERSION}-{vocab_size}-{h.hexdigest()[:12]}"


def _paths(d: Path) -> DefaultCorpus:
    return DefaultCorpus(d, str(d / "tokenizer.model"), str(d / "topics_text_document"),
                         str(d / "topics_text_sentence"))


def _build(d: Path, vocab_size: int) -> None:
    docs = corpus_documents()
    lines = [line for doc in docs for line in doc.splitlines() if line.strip()]
    p = _paths(d)
    train_sentencepiece(lines, p.tokenizer_model, vocab_size, MODEL_TYPE, num_threads=1)
    write_documents(p.document_prefix, docs, GPTSentencePieceTokenizer(p.tokenizer_model),
                    split=False, append_eod=True)
    write_documents(p.sentence_prefix, docs, SentencePieceTokenizer(p.tokenizer_model),
                    split=True, append_eod=False)


def default_corpus(cache_root: str | Path | None = None,
                   vocab_size: int = DEFAULT_VOCAB_SIZE, builder: bool | None = None,
                   **wait) -> DefaultCorpus:
    """Paths of the default corpus, building it first (builder: default local rank 0) or
    waiting for its builder (`wait`: wait_until's keywords) if this cache does not have it."""
    root = Path(cache_root) if cache_root else user_cache_dir()
    final = _corpus_dir(root, vocab_size)
    if not final.is_dir():
        if not (builder if builder is not None else is_local_builder()):
            wait_until(final.is_dir, final, **wait)
            return _paths(final)
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
            atomic_build_dir(final, lambda tmp: _build(tmp, vocab_size))
        except OSError as e:
            raise DataError(f"{final.parent}: cannot build the default corpus there "
                            f"({e.strerror or e}): set MEGATRON_2BW_CACHE to a writable "
                            "directory") from None
    return _paths(final)


def unigram_entropy(prefix: str) -> float:
    """Entropy (nats/token) of the token frequencies of an indexed dataset: the loss of the
    best model that ignores context. A language model must go below it to have learned context."""
    counts = np.bincount(MMapIndexedDataset(prefix).tokens().astype(np.int64))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def default_corpus_unigram_entropy(cache_root: str | Path | None = None,
                                   vocab_size: int = DEFAULT_VOCAB_SIZE) -> float:
    return unigram_entropy(default_corpus(cache_root, vocab_size).document_prefix)
