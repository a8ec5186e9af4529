"""The input pipeline (--num-workers, data/prefetch.py): N loader worker processes give exactly
the iterator's microbatches (same values, same order, from any start batch) for N = 0 and 2; a
sample that cannot be read is one clear line in the training process, never a hang; a loader
draws nothing from the training's random generator; ranks that do not read data start no
workers. (Worker processes: this tier, not tests/unit.)"""
import os
import signal
from types import SimpleNamespace

import pytest
import torch

from megatron_2bw.data.bert_mock import BertBatches, MockBertDataset
from megatron_2bw.data.errors import DataError
from megatron_2bw.data.mock import GPTBatches, MockGPTDataset
from megatron_2bw.data.prefetch import Loader, close_pipelines, input_pipeline, num_workers_for


def _take(it, n):
    return [next(it) for _ in range(n)]


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))


def _gpt(start):
    return GPTBatches(MockGPTDataset(97, 16, seed=3), 2, 4, 2, 1, start_batch=start)


def _bert(start):
    return BertBatches(MockBertDataset(97, 16, seed=3), 2, 4, 1, 0, start_batch=start)


@pytest.mark.parametrize("make,start", [(_gpt, 0), (_gpt, 5), (_bert, 5)],
                         ids=["gpt", "gpt-from-5", "bert-from-5"])
@pytest.mark.parametrize("workers", [0, 2])
def test_same_microbatches_in_the_same_order_for_any_number_of_workers(make, start, workers):
    expected = _take(make(start), 13)
    data = Loader(make(start), "train data", num_workers=workers)
    got = _take(data, 13)
    data.close()
    assert len(got) == 13 and all(_equal(a, b) for a, b in zip(got, expected))


class Failing:
    """Samples of a mock GPT dataset; sample `bad` raises `error`."""

    def __init__(self, bad=6, error=IndexError("sample 77 out of range: the dataset has 76 "
                                               "samples\nsecond line")):
        self.inner, self.bad, self.error = MockGPTDataset(50, 8), bad, error

    def __getitem__(self, i):
        if i == self.bad:
            raise self.error
        return self.inner[i]


class Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("cannot pickle")


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sample_that_cannot_be_read_is_one_line_in_the_training_process(workers):
    # micro-batch 2, m = 2: sample 6 is microbatch 3 = batch 1 microbatch 1
    data = Loader(GPTBatches(Failing(), 2, 2), "train data (GPTDataset)", num_workers=workers)
    assert len(_take(data, 3)) == 3
    with pytest.raises(DataError) as e:
        next(data)
    assert str(e.value) == ("train data (GPTDataset): reading batch 1 microbatch 1 failed: "
                            "IndexError: sample 77 out of range: the dataset has 76 samples")
    assert isinstance(e.value.__cause__, IndexError)
    with pytest.raises(StopIteration):  # and it stays finished
        next(data)


def test_an_unpicklable_error_of_a_worker_still_comes_back_as_its_line():
    data = Loader(GPTBatches(Failing(bad=0, error=Unpicklable("bad header")), 2, 2), "eval data",
                  num_workers=1)
    with pytest.raises(DataError, match="^eval data: reading batch 0 microbatch 0 failed: "
                                        "Unpicklable: bad header$"):
        next(data)


def test_an_error_read_ahead_but_never_needed_is_not_raised():
    data = Loader(GPTBatches(Failing(bad=8), 2, 2), "train data", num_workers=2, prefetch=4)
    assert len(_take(data, 4)) == 4  # the workers have already read past these
    data.close()


def test_workers_leave_signals_to_the_main_process_and_end_with_close():
    """SLURM signals every process of a job: a worker must not die of the SIGTERM that makes
    the main process save a checkpoint."""
    data = Loader(_gpt(0), "train data", num_workers=2)
    expected = _take(_gpt(0), 6)
    got = _take(data, 2)
    workers = list(data._it._workers)
    for w in workers:
        os.kill(w.pid, signal.SIGTERM)
        os.kill(w.pid, signal.SIGUSR1)
    got += _take(data, 4)
    assert all(w.is_alive() for w in workers)
    assert all(_equal(a, b) for a, b in zip(got, expected))
    data.close()
    assert not any(w.is_alive() for w in workers)
    with pytest.raises(StopIteration):
        next(data)


def test_a_killed_worker_is_an_error_not_a_hang():
    data = Loader(_gpt(0), "train data", num_workers=1)
    next(data)
    # torch's SIGCHLD handler may raise its RuntimeError at once; else next() says it
    with pytest.raises((DataError, RuntimeError), match="killed by signal|exited unexpectedly"):
        os.kill(data._it._workers[0].pid, signal.SIGKILL)
        for _ in range(1000):
            next(data)
    data.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_starting_a_loader_draws_nothing_from_the_training_generator(workers):
    state = torch.get_rng_state()
    data = Loader(_gpt(0), "train data", num_workers=workers)
    next(data)
    assert torch.equal(torch.get_rng_state(), state)
    data.close()


def test_only_the_first_and_last_stage_start_workers():
    middle = SimpleNamespace(is_first_stage=False, is_last_stage=False)
    it = _gpt(0)
    assert input_pipeline(it, "train data", middle, "cpu", num_workers=2) is it
    assert it.k == 0  # nothing read
    cycle = iter([torch.zeros(1)] * 3)  # not index-addressable: read as it is
    assert input_pipeline(cycle, "eval data", SimpleNamespace(is_first_stage=True,
                                                              is_last_stage=True), "cpu") is cycle
    for first, last in ((True, False), (False, True)):
        grid = SimpleNamespace(is_first_stage=first, is_last_stage=last)
        data = input_pipeline(_gpt(0), "train data", grid, "cpu", num_workers=1)
        assert isinstance(data, Loader) and data.name == "train data (MockGPTDataset)"
        assert data.num_workers == 1 and not data.pin
        assert len(data._it._workers) == 1
        close_pipelines(data, None, it)
    # the default: Megatron's 2 where CUDA is, none on CPUs (the ranks' math uses the cores)
    assert (num_workers_for("cuda", None), num_workers_for("cpu", None)) == (2, 0)
    assert num_workers_for("cpu", 3) == 3 and num_workers_for("cuda:1", 0) == 0
    grid = SimpleNamespace(is_first_stage=True, is_last_stage=True)
    data = input_pipeline(_gpt(0), "train data", grid, "cpu")
    assert data.num_workers == 0 and not hasattr(data._it, "_workers")
    close_pipelines(data)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("workers", [0, 2])
def test_microbatches_are_pinned_on_cuda(workers):
    grid = SimpleNamespace(is_first_stage=True, is_last_stage=True)
    data = input_pipeline(GPTBatches(MockGPTDataset(50, 8), 2, 2), "train data", grid, "cuda",
                          num_workers=workers)
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
    from megatron_2bw.parallel.grid import ProcessGrid
    from megatron_2bw.training.build import batches
    from megatron_2bw.training.loop import train
    grid = ProcessGrid.from_config(cfg, rank, world_size).init_groups()
    data = BrokenAt(cfg)
    train(cfg, grid, "cpu", make_data=lambda s: batches(cfg, data, grid.data, grid.dp_rank, s),
          log=lambda line: None)


def test_a_failed_read_stops_training_with_one_line():
    from megatron_2bw.config.build import build_config
    from megatron_2bw.pretrain import build_parser
    from megatron_2bw.training.spawn import spawn
    argv = ("--mock-data --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
            "--micro-batch-size 2 --global-batch-size 4 --train-iters 4 --num-workers 2").split()
    cfg = build_config(build_parser("gpt").parse_args(argv), "gpt", 1).config
    assert cfg.train.num_workers == 2  # read by two worker processes
    # sample 9 is in batch 2 (samples 8-11), microbatch 0 (samples 8-9)
    with pytest.raises(Exception, match=r"DataError: train data \(BrokenAt\): reading batch 2 "
                                        r"microbatch 0 failed: OSError: short read at byte 4096"):
        spawn(_train_on_broken_data, 1, args=(cfg,), timeout_minutes=1)


def test_a_worker_reaped_after_its_pipe_reset_is_still_named():
    """A worker killed while sending resets its pipe before its exit is visible (the race that
    once failed CI): the error path waits for the exit and names the worker and the signal."""
    from megatron_2bw.data.prefetch import _dead_worker

    class Dying:
        pid, exitcode, calls = 4321, None, 0

        def is_alive(self):
            self.calls += 1
            if self.calls < 5:
                return True
            self.exitcode = -9
            return False
    it = SimpleNamespace(_workers=[Dying()])
    assert _dead_worker(it) == ", worker 4321 exited unexpectedly (killed by signal 9)"
    alive = SimpleNamespace(_workers=[SimpleNamespace(pid=1, is_alive=lambda: True)])
    assert _dead_worker(alive, wait_s=0.05) == ""  # none died: the loader's own message
