"""JSONL -> Megatron indexed datasets (the engine of tools/preprocess_data.py).

Each JSON line is a document; for every `--json-keys` key K it writes
`{output_prefix}_{K}_{document|sentence}.bin/.idx`. With `split_sentences` each sentence is one
sequence of the document (for BERT); otherwise the document is one sequence (for GPT).
`append_eod` adds the tokenizer's eod to every non-empty document.

Bad input stops the run with a one-line DataError and writes nothing: a line that is not a JSON
object, a missing key, a value that is not a string (`null` is not the text "None"), an input
with no documents or no tokens. The outputs appear only when every key's .bin and .idx are
complete (IndexedDatasetBuilder writes temporaries and renames), so a failed run leaves earlier
outputs with the same prefix untouched.
"""
from __future__ import annotations

import itertools
import json
import multiprocessing
import re
import sys
import time
from typing import Iterable, Iterator

from megatron_2bw.config.input_files import decode_problem, file_error
from megatron_2bw.data.errors import DataError
from megatron_2bw.data.indexed_dataset import (IndexedDatasetBuilder, data_file_path,
                                               index_file_path, optimal_dtype)
from megatron_2bw.data.tokenizer import build_tokenizer

# A sentence ends at . ! ? (optionally followed by quotes/brackets) before whitespace and an
# upper-case letter, digit or quote, or at a blank line. Deterministic; no model download.
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[A-Z0-9\"'(\[])|\n\s*\n")


def split_sentences(text: str) -> list[str]:
    return [s.strip() for s in _SENTENCE_END.split(text) if s and s.strip()]


def output_prefix(prefix: str, key: str, split: bool) -> str:
    return f"{prefix}_{key}_{'sentence' if split else 'document'}"


class Encoder:
    """Tokenizes one JSON line; built once per worker process."""

    def __init__(self, tokenizer_type, tokenizer_model, vocab_size, json_keys, split, eod,
                 tokenizer_options: dict | None = None):
        self.args = (tokenizer_type, tokenizer_model, vocab_size)
        self.options = dict(tokenizer_options or {})
        self.json_keys, self.split, self.append_eod = json_keys, split, eod
        self.tokenizer = None

    def initializer(self):
        self.tokenizer = build_tokenizer(*self.args, **self.options)

    def encode_text(self, text: str) -> tuple[list[int], list[int]]:
        """(token ids, sequence lengths) of one document."""
        if self.tokenizer is None:
            self.initializer()
        ids, lengths = [], []
        for sentence in (split_sentences(text) if self.split else [text]):
            s = self.tokenizer.tokenize(sentence)
            if s:
                ids += s
                lengths.append(len(s))
        if ids and self.append_eod:
            ids.append(self.tokenizer.eod)
            lengths[-1] += 1
        return ids, lengths

    def encode(self, item: tuple[int, str]):
        lineno, line = item
        try:
            texts = document_texts(line, lineno, self.json_keys)
            out = {key: self._encode_key(text, key, lineno) for key, text in texts.items()}
        except DataError as e:
            return lineno, None, str(e)
        return lineno, out, len(line.encode())

    def _encode_key(self, text: str, key: str, lineno: int):
        try:
            return self.encode_text(text)
        except DataError as e:
            raise DataError(f"line {lineno}: {key!r}: {e}") from None


_JSON_TYPES = {type(None): "null", bool: "a boolean", int: "a number", float: "a number",
               list: "a list", dict: "an object"}


def document_texts(line: str, lineno: int, json_keys) -> dict[str, str]:
    """{key: text} of one JSONL line, or a one-line DataError naming the line and the key."""
    try:
        doc = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"line {lineno}: not JSON ({e.msg})") from None
    if not isinstance(doc, dict):
        raise DataError(f"line {lineno}: {_JSON_TYPES.get(type(doc), type(doc).__name__)}, "
                        "not a JSON object: each line must be one document, e.g. "
                        '{"text": "..."}')
    out = {}
    for key in json_keys:
        if key not in doc:
            raise DataError(f"line {lineno}: no key {key!r} (--json-keys; the line has "
                            f"{', '.join(map(repr, doc)) or 'no keys'})")
        value = doc[key]
        if not isinstance(value, str):
            raise DataError(f"line {lineno}: {key!r} is "
                            f"{_JSON_TYPES.get(type(value), type(value).__name__)}, not a "
                            "string: fix or drop the line")
        out[key] = value
    return out


_WORKER: Encoder | None = None


def _init_worker(encoder: Encoder) -> None:
    global _WORKER
    _WORKER = encoder
    _WORKER.initializer()


def _encode_in_worker(item):
    return _WORKER.encode(item)


class Progress:
    """A one-line progress report on stderr: documents, documents/s, MB/s."""

    def __init__(self, every: int = 1000, stream=None):
        stream = stream or sys.stderr
        self.every, self.stream, self.t0 = every, stream, time.perf_counter()
        self.docs = self.bytes = 0
        self.tty = hasattr(stream, "isatty") and stream.isatty()

    def update(self, nbytes: int) -> None:
        self.docs += 1
        self.bytes += nbytes
        if self.every and self.docs % self.every == 0:
            self.show()

    def line(self) -> str:
        dt = max(time.perf_counter() - self.t0, 1e-9)
        return (f"processed {self.docs} documents | {self.docs / dt:.1f} docs/s | "
                f"{self.bytes / dt / 1e6:.2f} MB/s")

    def show(self, final: bool = False) -> None:
        if final and not self.tty and self.docs and self.every and self.docs % self.every == 0:
            return  # the last line already says it
        end = "\n" if final or not self.tty else ""
        print(("\r" if self.tty else "") + self.line(), end=end, file=self.stream, flush=True)


INPUT_FIX = "--input must be UTF-8 JSONL (one JSON object a line) or UTF-8 text"


def numbered_lines(path: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of the non-empty lines of an --input file, read as it streams; a
    file that cannot be read or a line that is not UTF-8 text is a one-line DataError naming
    the line (binary data and UTF-16 named as such)."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise DataError(f"{path}: cannot read the --input file ({e.strerror})") from None
    with f:
        for i, raw in enumerate(f, start=1):
            problem = decode_problem(raw) if i == 1 or b"\x00" in raw else None
            if problem and not problem[0].startswith(("UTF-16", "binary")):
                problem = None  # another encoding: named with its column below
            if problem is None:
                try:
                    line = raw.decode("utf-8-sig" if i == 1 else "utf-8")
                except UnicodeDecodeError as e:
                    problem = (f"not UTF-8 text (byte 0x{raw[e.start]:02x} at column "
                               f"{e.start + 1}: Latin-1 or another encoding?)",
                               "save it as UTF-8")
            if problem:
                raise file_error(path, f"line {i}: {problem[0]}, nothing written",
                                 f"{problem[1]}: {INPUT_FIX}", DataError)
            if line.strip():
                yield i, line


def preprocess_jsonl(input_path: str, prefix: str, json_keys: Iterable[str] = ("text",),
                     tokenizer_type: str = "GPTSentencePieceTokenizer",
                     tokenizer_model: str | None = None, vocab_size: int | None = None,
                     split_sentences: bool = False, append_eod: bool = False, workers: int = 1,
                     log_interval: int = 1000, progress_stream=None,
                     tokenizer_options: dict | None = None) -> dict[str, str]:
    """Tokenize a JSONL file into indexed datasets. Returns {json key: output prefix}.
    tokenizer_options: build_tokenizer's keyword options (--vocab-file, --merge-file, ...)."""
    json_keys = list(json_keys)
    options = dict(tokenizer_options or {})
    tokenizer = build_tokenizer(tokenizer_type, tokenizer_model, vocab_size, **options)  # fail fast
    encoder = Encoder(tokenizer_type, tokenizer_model, vocab_size, json_keys, split_sentences,
                      append_eod, options)
    outs = {k: output_prefix(prefix, k, split_sentences) for k in json_keys}
    lines = numbered_lines(input_path)
    first = next(lines, None)  # an unreadable or empty input fails before anything is written
    if first is None:
        raise DataError(f"{input_path}: no documents (the --input file is empty; nothing "
                        "written)")
    dtype = optimal_dtype(tokenizer.vocab_size)
    builders: dict[str, IndexedDatasetBuilder] = {}
    progress = Progress(log_interval, progress_stream)
    pool = None
    try:
        for k, p in outs.items():
            builders[k] = IndexedDatasetBuilder(data_file_path(p), dtype)
        lines = itertools.chain([first], lines)
        if workers > 1:
            pool = multiprocessing.get_context("spawn").Pool(workers, _init_worker, (encoder,))
            docs = pool.imap(_encode_in_worker, lines, chunksize=32)
        else:
            encoder.tokenizer = tokenizer
            docs = map(encoder.encode, lines)
        for _, doc, info in docs:
            if doc is None:
                raise DataError(f"{input_path}: {info} (nothing written)")
            for key, (ids, lengths) in doc.items():
                builders[key].add_document(ids, lengths)
            progress.update(info)
        for key, b in builders.items():
            if b.num_tokens == 0:
                raise DataError(f"{input_path}: the {progress.docs} documents have no text "
                                f"under {key!r} (every value is empty; nothing written)")
        progress.show(final=True)
        for key, b in builders.items():
            b.prepare(index_file_path(outs[key]))
        for b in builders.values():
            b.commit()
    finally:
        if pool is not None:
            pool.terminate()
        for b in builders.values():
            b.abort()
    return outs


def write_documents(prefix: str, documents: Iterable[str], tokenizer, split: bool = False,
                    append_eod: bool = True) -> str:
    """Tokenize in-process texts into PREFIX.bin/.idx (used for the default corpus and tests)."""
    encoder = Encoder(None, None, None, (), split, append_eod)
    encoder.tokenizer = tokenizer
    builder = IndexedDatasetBuilder(data_file_path(prefix), optimal_dtype(tokenizer.vocab_size))
    try:
        for text in documents:
            builder.add_document(*encoder.encode_text(text))
        builder.finalize(index_file_path(prefix))
    finally:
        builder.abort()
    return prefix
