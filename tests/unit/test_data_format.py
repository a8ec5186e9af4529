"""Megatron's mmap indexed format, byte for byte: layout parsed with plain struct/numpy, the
JSONL -> tools/preprocess_data.py -> reader round trip, and one-line errors for bad files."""
import json
import os
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_2bw.data.errors import DataError
from megatron_2bw.data.indexed_dataset import (IndexedDatasetBuilder, MMapIndexedDataset,
                                               optimal_dtype)
from megatron_2bw.data.tokenizer import GPTSentencePieceTokenizer, train_sentencepiece

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import preprocess_data  # noqa: E402

DTYPE_OF_CODE = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64,
                 7: np.float32, 8: np.uint16}


def parse_idx(path):
    """The .idx layout of the issue, read without our reader."""
    raw = Path(path).read_bytes()
    assert raw[:9] == b"MMIDIDX\x00\x00"
    version, code, count, docs = struct.unpack("<QBQQ", raw[9:34])
    off = 34
    lengths = np.frombuffer(raw, "<i4", count, off)
    pointers = np.frombuffer(raw, "<i8", count, off + 4 * count)
    doc_idx = np.frombuffer(raw, "<i8", docs, off + 12 * count)
    assert len(raw) == off + 12 * count + 8 * docs
    return version, code, lengths, pointers, doc_idx


def write(prefix, docs, dtype=np.uint16):
    """docs: list of documents, each a list of sentences (lists of ids)."""
    b = IndexedDatasetBuilder(f"{prefix}.bin", dtype)
    for doc in docs:
        b.add_document([t for s in doc for t in s], [len(s) for s in doc])
    b.finalize(f"{prefix}.idx")
    return str(prefix)


DOCS = [[[5, 6, 7], [8]], [[9, 10]], [[11], [12, 13], [14, 15, 16]]]


@pytest.mark.parametrize("dtype,code", [(np.uint16, 8), (np.int32, 4), (np.uint8, 1)])
def test_layout_is_megatrons(tmp_path, dtype, code):
    prefix = write(tmp_path / "d", DOCS, dtype)
    version, got_code, lengths, pointers, doc_idx = parse_idx(prefix + ".idx")
    assert (version, got_code) == (1, code)
    assert lengths.tolist() == [3, 1, 2, 1, 2, 3]
    size = np.dtype(dtype).itemsize
    assert pointers.tolist() == [0, 3 * size, 4 * size, 6 * size, 7 * size, 9 * size]
    assert doc_idx.tolist() == [0, 2, 3, 6]
    flat = [t for d in DOCS for s in d for t in s]
    assert Path(prefix + ".bin").read_bytes() == np.asarray(flat, dtype).tobytes()


def test_reader_returns_zero_copy_views(tmp_path):
    ds = MMapIndexedDataset(write(tmp_path / "d", DOCS))
    assert len(ds) == 6 and ds.document_indices.tolist() == [0, 2, 3, 6]
    assert ds[0].tolist() == [5, 6, 7] and ds[5].tolist() == [14, 15, 16]
    assert ds.get(5, offset=1, length=2).tolist() == [15, 16]
    view = ds.get(2)
    assert not view.flags.owndata and not view.flags.writeable
    assert np.shares_memory(view, ds.tokens())


def test_optimal_dtype_and_merge(tmp_path):
    assert optimal_dtype(65499) == np.uint16 and optimal_dtype(65500) == np.int32
    a, b = write(tmp_path / "a", DOCS[:1]), write(tmp_path / "b", DOCS[1:])
    m = IndexedDatasetBuilder(str(tmp_path / "m.bin"), np.uint16)
    m.add_index(a)
    m.add_index(b)
    m.finalize(str(tmp_path / "m.idx"))
    assert parse_idx(tmp_path / "m.idx")[4].tolist() == [0, 2, 3, 6]
    assert (tmp_path / "m.bin").read_bytes() == (tmp_path / "a.bin").read_bytes() + \
        (tmp_path / "b.bin").read_bytes()


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    from pydoc_data.topics import topics
    lines = [ln for k in sorted(topics)[:20] for ln in topics[k].splitlines() if ln.strip()]
    path = tmp_path_factory.mktemp("tok") / "tok.model"
    return train_sentencepiece(lines, str(path), 400, "bpe")


def test_split_sentences_writes_one_sequence_per_sentence(tmp_path, sp_model):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"text": "First one here. Second one! Third?\n\nNew para"}) + "\n")
    assert preprocess_data.main(["--input", str(src), "--output-prefix", str(tmp_path / "o"),
                                 "--tokenizer-model", sp_model, "--split-sentences"]) == 0
    tok = GPTSentencePieceTokenizer(sp_model)
    sents = ["First one here.", "Second one!", "Third?", "New para"]
    ds = MMapIndexedDataset(str(tmp_path / "o_text_sentence"))
    assert ds.document_indices.tolist() == [0, 4]
    assert [ds[i].tolist() for i in range(4)] == [tok.tokenize(s) for s in sents]


def one_line_error(fn, *names):
    with pytest.raises(DataError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in names), msg
    return msg


def test_missing_files(tmp_path):
    one_line_error(lambda: MMapIndexedDataset(str(tmp_path / "nope")), "nope.idx")
    prefix = write(tmp_path / "d", DOCS)
    Path(prefix + ".bin").unlink()
    one_line_error(lambda: MMapIndexedDataset(prefix), "d.bin")


@pytest.mark.parametrize("corrupt,words", [
    (lambda raw: b"NOTANIDX!" + raw[9:], ["not a Megatron mmap index"]),
    (lambda raw: raw[:20], ["truncated"]),
    (lambda raw: raw[:9] + struct.pack("<Q", 2) + raw[17:], ["version 2"]),
    (lambda raw: raw[:17] + b"\x09" + raw[18:], ["dtype code 9"]),
    (lambda raw: raw[:-5], ["truncated", "6 sequences"]),
    (lambda raw: b"", ["not a Megatron mmap index"]),
])
def test_bad_index(tmp_path, corrupt, words):
    prefix = write(tmp_path / "d", DOCS)
    idx = Path(prefix + ".idx")
    idx.write_bytes(corrupt(idx.read_bytes()))
    one_line_error(lambda: MMapIndexedDataset(prefix), "d.idx", *words)


def test_bin_shorter_than_index(tmp_path):
    prefix = write(tmp_path / "d", DOCS)
    b = Path(prefix + ".bin")
    b.write_bytes(b.read_bytes()[:-2])
    one_line_error(lambda: MMapIndexedDataset(prefix), "d.bin", "shorter than its index")


def test_preprocess_errors_are_one_line(tmp_path, sp_model, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "ok"}\nnot json\n')
    out = str(tmp_path / "o")
    assert preprocess_data.main(["--input", str(src), "--output-prefix", out,
                                 "--tokenizer-model", sp_model]) == 2
    assert "line 2: not JSON" in capsys.readouterr().err
    assert preprocess_data.main(["--input", str(src), "--output-prefix", out,
                                 "--tokenizer-model", str(tmp_path / "missing.model")]) == 2
    err = capsys.readouterr().err.strip()
    assert "missing.model" in err and "\n" not in err


# ---- index contents that disagree with themselves or with the .bin (flipped bytes, relabels) ----
def _idx_arrays(raw: bytes):
    """(header, lengths, pointers, doc index) as writable copies of a DOCS index."""
    count, docs = struct.unpack("<QQ", raw[18:34])
    lengths = np.frombuffer(raw, "<i4", count, 34).copy()
    pointers = np.frombuffer(raw, "<i8", count, 34 + 4 * count).copy()
    doc_idx = np.frombuffer(raw, "<i8", docs, 34 + 12 * count).copy()
    return raw[:34], lengths, pointers, doc_idx


def _rewrite(idx: Path, edit) -> None:
    head, lengths, pointers, doc_idx = _idx_arrays(idx.read_bytes())
    head = edit(head, lengths, pointers, doc_idx) or head
    idx.write_bytes(head + lengths.tobytes() + pointers.tobytes() + doc_idx.tobytes())


def _flip_length_sign(head, lengths, pointers, doc_idx):
    lengths[1] = -lengths[1]


def _grow_length(head, lengths, pointers, doc_idx):
    lengths[2] += 5  # overlaps the next sequence: pointers no longer follow the lengths


def _flip_pointer_byte(head, lengths, pointers, doc_idx):
    pointers[3] ^= 1 << 8


def _relabel_uint8(head, lengths, pointers, doc_idx):
    return head[:17] + b"\x01" + head[18:]  # dtype code 8 (uint16) -> 1 (uint8)


@pytest.mark.parametrize("edit,words", [
    (_flip_length_sign, ["sequence 1 has length -1 (negative)"]),
    (_grow_length, ["sequence 3 starts at byte", "lengths and pointers disagree"]),
    (_flip_pointer_byte, ["sequence 3 starts at byte", "lengths and pointers disagree"]),
    (_relabel_uint8, ["they fit 2-byte tokens", "header says uint8", "dtype code is wrong"]),
])
def test_inconsistent_index_contents(tmp_path, edit, words):
    prefix = write(tmp_path / "d", DOCS)
    _rewrite(Path(prefix + ".idx"), edit)
    one_line_error(lambda: MMapIndexedDataset(prefix), "d.idx", *words)


def test_relabelled_dtype_of_a_single_sequence_is_caught_by_the_bin_size(tmp_path):
    prefix = write(tmp_path / "d", [[[5, 6, 7, 8]]])
    _rewrite(Path(prefix + ".idx"), _relabel_uint8)
    one_line_error(lambda: MMapIndexedDataset(prefix), "d.bin", "longer than its index",
                   "exactly 2x", "2-byte tokens, not uint8")


def test_bin_longer_than_index(tmp_path):
    prefix = write(tmp_path / "d", DOCS)
    b = Path(prefix + ".bin")
    b.write_bytes(b.read_bytes() + b"\x00\x00\x01")
    one_line_error(lambda: MMapIndexedDataset(prefix), "d.bin", "longer than its index says")


# ---- the builder: outputs appear whole or not at all ----------------------------------------
def test_builder_writes_temporaries_and_renames_on_finalize(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "d.bin"), np.uint16)
    b.add_document([1, 2, 3], [3])
    names = [p.name for p in tmp_path.iterdir()]  # fs.unique_temp: .tmp-NAME-HOST-PID-RANDOM
    assert len(names) == 1 and names[0].startswith(".tmp-d.bin-")
    assert f"-{os.getpid()}-" in names[0]
    b.finalize(str(tmp_path / "d.idx"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.bin", "d.idx"]
    assert MMapIndexedDataset(str(tmp_path / "d"))[0].tolist() == [1, 2, 3]


def test_builder_abort_leaves_the_previous_dataset_untouched(tmp_path):
    prefix = write(tmp_path / "d", DOCS)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    b = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    b.add_document([9, 9], [2])
    b.prepare(prefix + ".idx")
    b.abort()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
