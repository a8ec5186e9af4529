"""GPT dataset: Megatron's sample index, splits, cached indices, determinism, resume, blending."""
import argparse
import os
import time

import numpy as np
import pytest
import torch

from megatron_2bw.data.blended_dataset import build_blending_indices, parse_data_path
from megatron_2bw.data.build import build_gpt_datasets, build_gpt_train_data
from megatron_2bw.data.errors import DataError
from megatron_2bw.data.gpt_dataset import (GPTDataset, build_sample_index, parse_split,
                                           split_indices)
from megatron_2bw.data.indexed_dataset import IndexedDatasetBuilder, MMapIndexedDataset
from megatron_2bw.data.mock import GPTBatches


def megatron_sample_index(sizes, doc_idx, seq_length):
    """A line-by-line port of Megatron's C++ helpers.build_sample_idx (the reference)."""
    num_samples = (int(sizes[doc_idx].sum()) - 1) // seq_length
    out = [(0, 0)]
    d, offset = 0, 0
    for _ in range(num_samples):
        remaining = seq_length + 1
        while remaining != 0:
            length = int(sizes[doc_idx[d]]) - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - 1
                remaining = 0
            else:
                d, offset = d + 1, 0
        out.append((d, offset))
    return np.array(out)


@pytest.mark.parametrize("seq_length", [1, 3, 8, 50])
def test_sample_index_matches_megatron(seq_length):
    rng = np.random.RandomState(seq_length)
    sizes = rng.randint(0, 12, size=40).astype(np.int32)
    sizes[5] = 0
    doc_idx = np.tile(np.arange(40, dtype=np.int32), 2)
    rng.shuffle(doc_idx)
    got = build_sample_index(sizes, doc_idx, seq_length)
    np.testing.assert_array_equal(got, megatron_sample_index(sizes, doc_idx, seq_length))


def make_dataset(path, num_docs=50, base=0, seed=0):
    """Documents of random lengths whose tokens are consecutive ids: doc k starts at 1000 * k."""
    rng = np.random.RandomState(seed)
    b = IndexedDatasetBuilder(f"{path}.bin", np.int32)
    for k in range(num_docs):
        n = int(rng.randint(1, 30))
        b.add_document(base + 1000 * k + np.arange(n), [n])
    b.finalize(f"{path}.idx")
    return str(path)


def test_samples_span_documents_in_document_index_order(tmp_path):
    ds = MMapIndexedDataset(make_dataset(tmp_path / "d"))
    gpt = GPTDataset(ds, np.arange(50), 200, 16, seed=3, cache_dir=tmp_path / "c")
    stream = np.concatenate([ds[int(d)] for d in gpt.document_index])
    assert len(gpt) >= 200
    for i in range(len(gpt)):
        k = int(gpt.shuffle_index[i])
        sample = gpt[i]
        assert sample.dtype == torch.int64 and sample.shape == (17,)
        np.testing.assert_array_equal(sample.numpy(), stream[k * 16:k * 16 + 17])
    assert sorted(gpt.shuffle_index.tolist()) == list(range(len(gpt)))


def test_split():
    assert parse_split("969, 30, 1") == pytest.approx([0.969, 0.030, 0.001])
    assert parse_split("98/2") == pytest.approx([0.98, 0.02, 0.0])
    assert split_indices(parse_split("969,30,1"), 1000) == [0, 969, 999, 1000]
    # megatron-core's split matrix: [round(c_k * n), round(c_k+1 * n)) of the running sums
    assert split_indices(parse_split("1,1,1"), 10) == [0, 3, 7, 10]
    assert split_indices(parse_split("90,5,5"), 50) == [0, 45, 48, 50]  # 47.5 rounds to 48
    for bad in ("", "a,b", "1,-1", "0,0,0", "1,2,3,4"):
        with pytest.raises(DataError, match="--split"):
            parse_split(bad)


def test_splits_use_disjoint_documents(tmp_path):
    prefix = make_dataset(tmp_path / "d", num_docs=100)
    train, valid, test = build_gpt_datasets([prefix], "80,20,0", 8, 1, (100, 20, 0),
                                            str(tmp_path / "c"))
    assert test is None
    docs = lambda d: {int(x) // 1000 for i in range(len(d)) for x in d[i]}  # noqa: E731
    assert docs(train) <= set(range(80)) and docs(valid) <= set(range(80, 100))


def test_indices_cached_and_reused(tmp_path):
    ds = MMapIndexedDataset(make_dataset(tmp_path / "d"))
    args = (ds, np.arange(50), 300, 8, 5, tmp_path / "c")
    first = GPTDataset(*args)
    files = sorted((tmp_path / "c").glob("*.npy"))
    assert first.built_indices and len(files) == 3
    stamps = [f.stat().st_mtime_ns for f in files]
    time.sleep(0.01)
    second = GPTDataset(*args)
    assert not second.built_indices
    assert [f.stat().st_mtime_ns for f in files] == stamps
    assert all(torch.equal(first[i], second[i]) for i in range(len(first)))
    other_seed = GPTDataset(ds, np.arange(50), 300, 8, 6, tmp_path / "c")
    assert other_seed.built_indices
    assert any(not torch.equal(first[i], other_seed[i]) for i in range(20))


def test_multi_epoch_and_resume(tmp_path):
    prefix = make_dataset(tmp_path / "d", num_docs=10)
    args = argparse.Namespace(data_path=[prefix], tokenizer_type="NullTokenizer",
                              vocab_size=60000, data_cache_path=str(tmp_path / "c"))
    data = build_gpt_train_data(args, seq_length=8, seed=1, num_samples=400)  # several epochs
    assert len(data.dataset) >= 400 and data.vocab_size == 60032
    full = GPTBatches(data.dataset, 2, 4, data_parallel_size=2, dp_rank=1)
    seen = [next(full) for _ in range(3 * 4)]
    resumed = GPTBatches(data.dataset, 2, 4, data_parallel_size=2, dp_rank=1, start_batch=2)
    for want in seen[8:]:
        got = next(resumed)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    inputs, labels = seen[0]
    assert inputs.shape == labels.shape == (2, 8) and inputs.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], labels[:, :-1])


def test_blending_weights_within_one_percent(tmp_path):
    a = make_dataset(tmp_path / "a", num_docs=30, base=0, seed=1)
    b = make_dataset(tmp_path / "b", num_docs=30, base=10 ** 6, seed=2)
    args = argparse.Namespace(data_path=["0.3", a, "0.7", b], split="1",
                              tokenizer_type="NullTokenizer", vocab_size=2 * 10 ** 6,
                              data_cache_path=str(tmp_path / "c"))
    data = build_gpt_train_data(args, seq_length=4, seed=7, num_samples=10_000)
    ds = data.dataset
    assert len(ds) == 10_000
    from_b = sum(int(ds[i][0]) >= 10 ** 6 for i in range(len(ds)))
    assert abs(from_b / 10_000 - 0.7) < 0.01
    for n in (100, 1000, 5000):  # low discrepancy at every prefix, not only on average
        assert abs(np.mean(ds.dataset_index[:n] == 1) - 0.7) < 0.01
    again = build_gpt_train_data(args, seq_length=4, seed=7, num_samples=10_000).dataset
    assert not again.built_indices and torch.equal(again[1234], ds[1234])


def test_blending_indices_and_data_path_parsing():
    idx, sample = build_blending_indices([1, 3], 8)
    assert idx.tolist() == [1, 0, 1, 1, 0, 1, 1, 1]  # Megatron's greedy (ties go to the first)
    assert sample[idx == 1].tolist() == list(range(int((idx == 1).sum())))
    assert parse_data_path(["A"]) == (["A"], None)
    assert parse_data_path("0.3 A 0.7 B") == (["A", "B"], [0.3, 0.7])
    assert parse_data_path(["A", "B"]) == (["A", "B"], None)
    for bad in (["0.3", "A", "B"], ["0.3", "A", "x", "B"], ["-1", "A", "2", "B"], []):
        with pytest.raises(DataError, match="--data-path"):
            parse_data_path(bad)


def test_flag_errors(tmp_path):
    prefix = make_dataset(tmp_path / "d")
    ns = lambda **kw: argparse.Namespace(data_cache_path=str(tmp_path / "c"), **kw)  # noqa: E731
    with pytest.raises(DataError, match="--tokenizer-model"):
        build_gpt_train_data(ns(data_path=[prefix]), 8, 1, 10)
    with pytest.raises(DataError, match="need --data-path"):
        build_gpt_train_data(ns(tokenizer_model="x.model"), 8, 1, 10)
    with pytest.raises(DataError, match="exclusive"):
        build_gpt_train_data(ns(mock_data=True, data_path=[prefix]), 8, 1, 10)
    with pytest.raises(DataError, match="missing.idx"):
        build_gpt_train_data(ns(data_path=[str(tmp_path / "missing")],
                                tokenizer_type="NullTokenizer", vocab_size=10), 8, 1, 10)
    with pytest.raises(DataError, match="--split 0,1,0: the train split has weight 0"):
        build_gpt_train_data(ns(data_path=[prefix], tokenizer_type="NullTokenizer",
                                vocab_size=60000, split="0,1,0"), 8, 1, 10)
    mock = build_gpt_train_data(argparse.Namespace(mock_data=True, vocab_size=128), 16, 1)
    assert mock.vocab_size == 128 and mock.dataset[0].shape == (17,)
