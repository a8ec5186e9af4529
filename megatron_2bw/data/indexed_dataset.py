"""Megatron-LM's mmap indexed dataset, byte for byte: `PREFIX.idx` (index) + `PREFIX.bin` (tokens).

.idx layout (all little-endian):

    b"MMIDIDX\\x00\\x00"         9 bytes magic
    u64 version = 1
    u8  dtype code              1 u8, 2 i8, 3 i16, 4 i32, 5 i64, 6 f64, 7 f32, 8 u16
    u64 sequence count S
    u64 document count D        = number of documents + 1
    i32[S] sequence lengths     (tokens)
    i64[S] sequence pointers    (byte offsets into .bin)
    i64[D] document indices     (document k = sequences [doc[k], doc[k+1]); doc[0] = 0)

.bin is the sequences' tokens back to back. A "sequence" is a document (`_document` files) or a
sentence (`_sentence` files, several per document). The reader memory-maps both files and
returns zero-copy numpy views. Before it hands out anything it checks that the index is
self-consistent and matches the .bin: lengths are >= 0, pointer k is the byte offset the lengths
before it imply (sum(lengths[:k]) x itemsize: Megatron never writes gaps), the document indices
rise from 0 to S, and the .bin holds exactly sum(lengths) x itemsize bytes. A flipped byte in the
lengths or pointers, a .bin/.idx pair from two runs, or a relabelled dtype code (uint16 data
called uint8) is a one-line DataError naming the file, never silently different tokens.

The builder writes both files under temporary names and renames them into place only when the
index is complete (`finalize`), so a failed or interrupted run leaves any previous PREFIX.bin/.idx
untouched and never a .bin without its .idx.
"""
from __future__ import annotations

import os
import struct

import numpy as np

from megatron_2bw.data.errors import DataError
from megatron_2bw.fs import AtomicFile

INDEX_HEADER = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
_HEADER_BYTES = len(INDEX_HEADER) + 8 + 1 + 8 + 8
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
          7: np.float32, 8: np.uint16}
_CODES = {np.dtype(v): k for k, v in DTYPES.items()}
_CHUNK = 1 << 22  # index entries checked per numpy pass (bounded temporary memory)
_REGENERATE = "regenerate it with tools/preprocess_data.py"


def dtype_code(dtype) -> int:
    return _CODES[np.dtype(dtype)]


def optimal_dtype(vocab_size: int | None):
    """Megatron's token dtype: uint16 when the vocabulary is under 65500, int32 otherwise."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def exists(prefix: str) -> bool:
    return os.path.isfile(index_file_path(prefix)) and os.path.isfile(data_file_path(prefix))


def _require_file(path: str, what: str) -> None:
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such {what} file (a data prefix P needs P.bin and P.idx, "
                        "as written by tools/preprocess_data.py)")


def index_header(idx_path: str) -> tuple[np.dtype, int, int, int]:
    """(token dtype, sequence count, document index count, file size) from the 34-byte header
    of a .idx; reads nothing else. One-line DataError when it is not a version-1 index."""
    _require_file(idx_path, "index")
    size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        head = f.read(_HEADER_BYTES)
    if head[:len(INDEX_HEADER)] != INDEX_HEADER:
        raise DataError(f"{idx_path}: not a Megatron mmap index (starts with "
                        f"{head[:9]!r}, expected {INDEX_HEADER!r}): regenerate it with "
                        "tools/preprocess_data.py")
    if len(head) < _HEADER_BYTES:
        raise DataError(f"{idx_path}: truncated header ({size} bytes, need "
                        f"{_HEADER_BYTES}): regenerate it with tools/preprocess_data.py")
    version, code, count, docs = struct.unpack("<QBQQ", head[len(INDEX_HEADER):])
    if version != INDEX_VERSION:
        raise DataError(f"{idx_path}: index version {version}, only version "
                        f"{INDEX_VERSION} is supported: regenerate it with "
                        "tools/preprocess_data.py")
    if code not in DTYPES:
        raise DataError(f"{idx_path}: unknown dtype code {code} (valid: 1-8): the file is "
                        "corrupt; regenerate it with tools/preprocess_data.py")
    return np.dtype(DTYPES[code]), count, docs, size


class IndexReader:
    """The parsed .idx: dtype, sequence_lengths, sequence_pointers, document_indices (memmapped).
    `checked_tokens`: the token count a full check of this very file found before (a cached
    verdict, data/consistency.py): the checks that read the whole index are skipped."""

    def __init__(self, idx_path: str, checked_tokens: int | None = None):
        self.path = idx_path
        self.dtype, count, docs, size = index_header(idx_path)
        self.sequence_count, self.document_count = count, docs
        need = _HEADER_BYTES + 12 * count + 8 * docs
        if size < need:
            raise DataError(f"{idx_path}: truncated: the header promises {count} sequences "
                            f"and {docs} document indices ({need} bytes) but the file has "
                            f"{size}: regenerate it with tools/preprocess_data.py")
        buf = np.memmap(idx_path, mode="r", order="C") if size else np.empty(0, np.uint8)
        self._mmap = buf
        off = _HEADER_BYTES
        self.sequence_lengths = np.frombuffer(buf, np.int32, count, off)
        self.sequence_pointers = np.frombuffer(buf, np.int64, count, off + 4 * count)
        self.document_indices = np.frombuffer(buf, np.int64, docs, off + 12 * count)
        d, whole = self.document_indices, checked_tokens is None
        if docs == 0 or d[0] != 0 or d[-1] != count or \
                (whole and docs > 1 and np.any(d[1:] < d[:-1])):
            raise DataError(f"{idx_path}: inconsistent document indices (must rise from 0 to "
                            f"the sequence count {count}): {_REGENERATE}")
        self.num_tokens = self._check_lengths_and_pointers() if whole else int(checked_tokens)

    def _check_lengths_and_pointers(self) -> int:
        """Lengths >= 0 and pointers = running byte offsets; returns the total token count."""
        lengths, pointers, item = self.sequence_lengths, self.sequence_pointers, self.dtype.itemsize
        before = 0  # tokens before the current chunk
        for lo in range(0, self.sequence_count, _CHUNK):
            n = lengths[lo:lo + _CHUNK].astype(np.int64)
            negative = np.flatnonzero(n < 0)
            if len(negative):
                i = lo + int(negative[0])
                raise DataError(f"{self.path}: sequence {i} has length {int(lengths[i])} "
                                f"(negative): the index is corrupt; {_REGENERATE}")
            starts = before + np.cumsum(n) - n  # tokens before each sequence
            wrong = np.flatnonzero(pointers[lo:lo + len(n)] != starts * item)
            if len(wrong):
                i, tokens = lo + int(wrong[0]), int(starts[wrong[0]])
                raise DataError(f"{self.path}: sequence {i} starts at byte "
                                f"{int(pointers[i])} but the lengths before it end at byte "
                                f"{tokens * item}{self._dtype_hint(int(pointers[i]), tokens)}: "
                                f"lengths and pointers disagree (corrupt index); {_REGENERATE}")
            before += int(n.sum())
        return before

    def _dtype_hint(self, nbytes: int, tokens: int) -> str:
        """' (they fit 2-byte tokens: ...)' when nbytes is tokens x another dtype's itemsize."""
        if tokens <= 0 or nbytes % tokens:
            return ""
        size = nbytes // tokens
        if size == self.dtype.itemsize or size not in (1, 2, 4, 8):
            return ""
        return (f" (they fit {size}-byte tokens, but the header says {self.dtype} with "
                f"{self.dtype.itemsize}: the dtype code is wrong)")

    def bin_bytes_needed(self) -> int:
        """The exact size of the matching .bin: every token, no gaps, nothing after."""
        return self.num_tokens * self.dtype.itemsize


class MMapIndexedDataset:
    """Read-only view of PREFIX.bin/.idx. `ds[i]` is sequence i as a zero-copy numpy array.
    `checked_tokens`: see IndexReader (the sizes and the header are checked in any case)."""

    def __init__(self, prefix: str, checked_tokens: int | None = None):
        self.prefix = prefix
        bin_path = data_file_path(prefix)
        self.index = IndexReader(index_file_path(prefix), checked_tokens)
        _require_file(bin_path, "data")
        have, need = os.path.getsize(bin_path), self.index.bin_bytes_needed()
        if have < need:
            raise DataError(f"{bin_path}: shorter than its index says ({have} bytes, "
                            f"{index_file_path(prefix)} needs {need}): the .bin is truncated "
                            "or belongs to another .idx; regenerate both")
        if have > need:
            ratio = have // need if need and have % need == 0 else 0
            hint = (f"; it is exactly {ratio}x: the data looks like "
                    f"{ratio * self.index.dtype.itemsize}-byte tokens, not "
                    f"{self.index.dtype} as the index says" if ratio in (2, 4, 8) else "")
            raise DataError(f"{bin_path}: longer than its index says ({have} bytes, "
                            f"{index_file_path(prefix)} accounts for {need}{hint}): the .bin "
                            "belongs to another .idx or the .idx is corrupt; regenerate both")
        self._bin = np.memmap(bin_path, mode="r", order="C") if have else np.empty(0, np.uint8)

    @property
    def dtype(self) -> np.dtype:
        return self.index.dtype

    @property
    def sequence_lengths(self) -> np.ndarray:
        return self.index.sequence_lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        return self.index.sequence_pointers

    @property
    def document_indices(self) -> np.ndarray:
        return self.index.document_indices

    @property
    def num_tokens(self) -> int:
        return self.index.num_tokens

    def __len__(self) -> int:
        return self.index.sequence_count

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence idx (to its end when length is None)."""
        if not 0 <= idx < len(self):
            raise IndexError(f"sequence {idx} out of range for {self.prefix} ({len(self)})")
        size = int(self.sequence_lengths[idx])
        if length is None:
            length = size - offset
        ptr = int(self.sequence_pointers[idx]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, self.dtype, length, ptr)

    def tokens(self) -> np.ndarray:
        """All tokens of the file (zero-copy)."""
        return np.frombuffer(self._bin, self.dtype, self.num_tokens, 0)


class IndexedDatasetBuilder:
    """Write PREFIX.bin as tokens arrive; `finalize(PREFIX.idx)` writes the index (Megatron API).

    Both files are written under temporary names (fs.AtomicFile: `.tmp-NAME-HOST-PID-RANDOM`)
    and renamed into place by `finalize` (or `prepare` + `commit`, to commit several datasets
    only once all are complete); `abort` deletes the temporaries. The .bin is renamed first and
    the .idx last."""

    def __init__(self, bin_path: str, dtype=np.int32):
        self.bin_path, self.dtype = bin_path, np.dtype(dtype)
        dtype_code(self.dtype)  # reject dtypes the format cannot name
        self._idx: AtomicFile | None = None  # once prepared
        self.data_file = AtomicFile(bin_path)
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]

    def add_item(self, tokens) -> None:
        """One sequence (call end_document after a document's last one)."""
        arr = np.asarray(tokens, dtype=self.dtype)
        self.data_file.write(arr.tobytes(order="C"))
        self.sequence_lengths.append(arr.size)

    def add_document(self, tokens, lengths) -> None:
        """One document: its tokens and the lengths of its sequences (sentences)."""
        arr = np.asarray(tokens, dtype=self.dtype)
        if int(sum(lengths)) != arr.size:
            raise ValueError(f"add_document: lengths sum to {sum(lengths)} but {arr.size} tokens")
        self.data_file.write(arr.tobytes(order="C"))
        self.sequence_lengths.extend(int(n) for n in lengths)
        self.document_indices.append(len(self.sequence_lengths))

    def end_document(self) -> None:
        self.document_indices.append(len(self.sequence_lengths))

    def add_index(self, prefix: str) -> None:
        """Append a whole existing dataset (same dtype) to this one."""
        other = MMapIndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise DataError(f"{index_file_path(prefix)}: dtype {other.dtype} differs from the "
                            f"builder's {self.dtype}: merge datasets of one dtype")
        base = len(self.sequence_lengths)
        self.sequence_lengths.extend(other.sequence_lengths.tolist())
        self.document_indices.extend((other.document_indices[1:] + base).tolist())
        with open(data_file_path(prefix), "rb") as f:
            while chunk := f.read(1 << 24):
                self.data_file.write(chunk)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.sequence_lengths))

    def finalize(self, idx_path: str) -> None:
        """Write the index and move PREFIX.bin and PREFIX.idx into place."""
        self.prepare(idx_path)
        self.commit()

    def prepare(self, idx_path: str) -> None:
        """Close and sync the .bin, write the .idx; both still under temporary names."""
        self.data_file.close()
        self._idx = AtomicFile(idx_path)
        write_index(self._idx, self.dtype, self.sequence_lengths, self.document_indices)
        self._idx.close()

    def commit(self) -> None:
        self.data_file.commit()
        self._idx.commit()
        self._idx = None

    def abort(self) -> None:
        """Drop the unfinished dataset: close and delete the temporary files (idempotent)."""
        self.data_file.discard()
        if self._idx is not None:
            self._idx.discard()


def write_index(f, dtype, sequence_lengths, document_indices) -> None:
    """The .idx of the sequences (module docstring) into the binary file object `f`."""
    dtype = np.dtype(dtype)
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths):
        np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    docs = np.asarray(document_indices, dtype=np.int64)
    f.write(INDEX_HEADER)
    f.write(struct.pack("<Q", INDEX_VERSION))
    f.write(struct.pack("<B", dtype_code(dtype)))
    f.write(struct.pack("<Q", len(lengths)))
    f.write(struct.pack("<Q", len(docs)))
    f.write(lengths.tobytes(order="C"))
    f.write(pointers.tobytes(order="C"))
    f.write(docs.tobytes(order="C"))
