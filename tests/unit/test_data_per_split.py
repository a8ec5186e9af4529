"""Megatron's per-split data (--train-data-path / --valid-data-path / --test-data-path, instead of
--data-path and --split): each split reads all of its own prefixes (blended by weight as
--data-path blends), the samples equal --data-path's with all the documents in that split, a rank
that reads no data sizes them from the .idx headers alone, and what Megatron refuses with them is
refused in one line."""
import numpy as np
import pytest

from megatron_2bw.data.build import NO_DATA, build_gpt_datasets, build_pretrain_data
from megatron_2bw.data.errors import DataError
from megatron_2bw.pretrain import build_parser

from indexed_data import write_documents as write

NULL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]


def data(argv, reads=True, valid_samples=6):
    args = build_parser("gpt").parse_args(NULL + argv)
    return build_pretrain_data(args, "gpt", seq_length=8, seed=3, train_samples=20,
                               valid_samples=valid_samples, reads=reads)


def tokens(ds) -> set:
    return {int(x) for i in range(len(ds)) for x in ds[i]}


def test_each_split_reads_all_of_its_own_data(tmp_path):
    a, b = write(tmp_path / "a", 1), write(tmp_path / "b", 60)
    d = data(["--train-data-path", a, "--valid-data-path", b])
    assert tokens(d.train) <= set(range(1, 41)) and tokens(d.valid) <= set(range(60, 100))
    # the same samples as --data-path with every document in that split
    whole = data(["--data-path", a, "--split", "1,0,0"], valid_samples=0)
    assert len(d.train) == len(whole.train)
    assert all(np.array_equal(d.train[i], whole.train[i]) for i in range(len(d.train)))
    valid = build_gpt_datasets([b], "0,1,0", 8, 3, (0, 6, 0))[1]  # --split refuses train 0
    assert [list(valid[i]) for i in range(len(valid))] == [list(d.valid[i])
                                                           for i in range(len(d.valid))]


def test_a_blend_per_split_and_no_validation_without_its_path(tmp_path):
    a, c = write(tmp_path / "a", 1), write(tmp_path / "c", 80)
    d = data(["--train-data-path", "0.5", a, "0.5", c])
    assert d.valid is None
    seen = tokens(d.train)
    assert seen & set(range(1, 41)) and seen & set(range(80, 120))


def test_a_rank_that_reads_no_data_gets_the_same_splits(tmp_path):
    a, b = write(tmp_path / "a", 1), write(tmp_path / "b", 60)
    d = data(["--train-data-path", a, "--valid-data-path", b, "--test-data-path", b],
             reads=False)
    assert d.train is NO_DATA and d.valid is NO_DATA


@pytest.mark.parametrize("extra,message", [
    (["--data-path", "X"], "--train-data-path with --data-path: give one data source"),
    (["--mock-data"], "--train-data-path with --mock-data: give one data source"),
    (["--split", "90,10,0"], "--split 90,10,0 with --train-data-path: each split reads all of "
                             "its own data; drop --split")])
def test_what_megatron_refuses_with_them_is_one_line(tmp_path, extra, message):
    a = write(tmp_path / "a", 1)
    with pytest.raises(DataError, match=message):
        data(["--train-data-path", a] + extra)


def test_validation_data_needs_training_data(tmp_path):
    b = write(tmp_path / "b", 60)
    with pytest.raises(DataError, match="--valid-data-path without --train-data-path: give the "
                                        "training data too"):
        data(["--valid-data-path", b])
