"""The input pipeline: microbatches read ahead in a background thread are exactly the iterator's
(same values, same order, from any start batch); a failure in the worker is one clear line in the
training thread, never a hang; ranks that do not read data spend nothing on it."""
import threading
from types import SimpleNamespace

import pytest
import torch

from megatron_2bw.data.bert_mock import BertBatches, MockBertDataset
from megatron_2bw.data.errors import DataError
from megatron_2bw.data.mock import GPTBatches, MockGPTDataset
from megatron_2bw.data.prefetch import Prefetcher, close_pipelines, input_pipeline


def _take(it, n):
    return [next(it) for _ in range(n)]


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("make", [
    lambda start: GPTBatches(MockGPTDataset(97, 16, seed=3), 2, 4, 2, 1, start_batch=start),
    lambda start: BertBatches(MockBertDataset(97, 16, seed=3), 2, 4, 1, 0, start_batch=start),
], ids=["gpt", "bert"])
@pytest.mark.parametrize("start", [0, 5])
def test_same_microbatches_in_the_same_order(make, start):
    expected = _take(make(start), 13)
    data = Prefetcher(make(start), "train data", depth=3)
    got = _take(data, 13)
    data.close()
    assert all(_equal(a, b) for a, b in zip(got, expected))


class Failing:
    """Microbatches 0, 1, 2, then the dataset fails."""

    def __init__(self, fail_at=3, error=IndexError("sample 77 out of range: the dataset has 76 "
                                                   "samples\nsecond line")):
        self.k, self.fail_at, self.error, self.m = 0, fail_at, error, 2

    @property
    def next_microbatch(self):
        return divmod(self.k, self.m)

    def __iter__(self):
        return self

    def __next__(self):
        if self.k == self.fail_at:
            raise self.error
        self.k += 1
        return torch.full((2,), self.k)


def test_a_worker_error_is_one_line_in_the_training_thread():
    data = Prefetcher(Failing(), "train data (GPTDataset)", depth=2)
    assert [int(x[0]) for x in _take(data, 3)] == [1, 2, 3]
    with pytest.raises(DataError) as e:
        next(data)
    msg = str(e.value)
    assert msg == ("train data (GPTDataset): reading batch 1 microbatch 1 failed: IndexError: "
                   "sample 77 out of range: the dataset has 76 samples")
    assert isinstance(e.value.__cause__, IndexError)
    with pytest.raises(StopIteration):  # and it stays finished
        next(data)


def test_an_error_read_ahead_but_never_needed_is_not_raised():
    data = Prefetcher(Failing(fail_at=4), "train data", depth=8)
    assert len(_take(data, 4)) == 4  # the worker has already hit the error beyond these
    data.close()


def test_the_end_of_the_iterator_ends_the_prefetcher():
    data = Prefetcher(iter([torch.zeros(1)] * 3), "eval data")
    assert len(list(data)) == 3
    with pytest.raises(StopIteration):
        next(data)


def test_a_vanished_worker_is_an_error_not_a_hang():
    class Vanishing(Prefetcher):
        def _work(self):  # the thread ends without handing over anything
            return

    data = Vanishing(iter(range(10)), "train data", poll_s=0.05)
    with pytest.raises(DataError, match="train data: the prefetch thread stopped without a result"):
        next(data)


def test_close_stops_a_worker_blocked_on_a_full_queue():
    data = Prefetcher(GPTBatches(MockGPTDataset(50, 8), 1, 2), "train data", depth=1,
                      poll_s=0.05)
    next(data)
    data.close()
    assert not data._thread.is_alive()
    with pytest.raises(StopIteration):
        next(data)


class Counting:
    def __init__(self):
        self.reads = 0

    def __iter__(self):
        return self

    def __next__(self):
        self.reads += 1
        return torch.zeros(1)


def test_only_the_first_and_last_stage_read_ahead():
    middle = SimpleNamespace(is_first_stage=False, is_last_stage=False)
    it = Counting()
    assert input_pipeline(it, "train data", middle, "cpu") is it
    threading.Event().wait(0.1)
    assert it.reads == 0
    for first, last in ((True, False), (False, True)):
        grid = SimpleNamespace(is_first_stage=first, is_last_stage=last)
        data = input_pipeline(GPTBatches(MockGPTDataset(50, 8), 1, 2), "train data", grid,
                              "cpu")
        assert isinstance(data, Prefetcher) and data.name == "train data (MockGPTDataset)"
        assert not data._pin
        close_pipelines(data, None, it)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_microbatches_are_pinned_on_cuda():
    grid = SimpleNamespace(is_first_stage=True, is_last_stage=True)
    data = input_pipeline(GPTBatches(MockGPTDataset(50, 8), 2, 2), "train data", grid, "cuda")
    tokens, labels = next(data)
    assert tokens.is_pinned() and labels.is_pinned()
    close_pipelines(data)


class BrokenAt:
    """A GPT dataset whose sample 9 cannot be read."""

    def __init__(self, cfg):
        from megatron_2bw.training.build import mock_dataset
        self.inner = mock_dataset(cfg)

    def __getitem__(self, i):
        if i == 9:
            raise OSError("short read at byte 4096 of corpus.bin")
        return self.inner[i]


def _train_on_broken_data(rank, world_size, cfg):
    from megatron_2bw.training.build import batches, build_grid
    from megatron_2bw.training.loop import train
    grid = build_grid(cfg, rank, world_size)
    data = BrokenAt(cfg)
    train(cfg, grid, "cpu", make_data=lambda s: batches(cfg, data, grid.data, grid.dp_rank, s),
          log=lambda line: None)


def test_a_failed_read_stops_training_with_one_line():
    from megatron_2bw.config.build import build_config
    from megatron_2bw.testing.launch import spawn
    from megatron_2bw.pretrain import build_parser
    argv = ("--mock-data --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
            "--micro-batch-size 2 --global-batch-size 4 --train-iters 4").split()
    cfg = build_config(build_parser("gpt").parse_args(argv), "gpt", 1).config
    # sample 9 is in batch 2 (samples 8-11), microbatch 0 (samples 8-9)
    with pytest.raises(Exception, match=r"DataError: train data \(BrokenAt\): reading batch 2 "
                                        r"microbatch 0 failed: OSError: short read at byte 4096"):
        spawn(_train_on_broken_data, 1, args=(cfg,), timeout_minutes=1)
