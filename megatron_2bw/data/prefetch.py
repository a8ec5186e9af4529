"""Reading microbatches ahead of the training loop: Megatron's `--num-workers N` loader processes
(default: 2 where CUDA is, as Megatron, else 0; `num_workers_for`).

    data = Loader(GPTBatches(...), "train data", num_workers=2, pin=device.type == "cuda")
    inputs, labels = next(data)   # the same microbatches, in the same order, for every N
    data.close()

A torch DataLoader reads the microbatch iterator's microbatches by index (k = batch * m +
microbatch, or its place in a batch-size ramp, `MicrobatchIterator.microbatch`), from the
iterator's next one on, in order: the
index decides every sample, so N changes when a microbatch is read, never which. N worker
processes (persistent, each `prefetch` microbatches ahead) build them; N = 0 builds each one in
the main process when the engine asks for it. With `pin` (CUDA only) they are moved to
page-locked memory, which makes the engine's `.to(device, non_blocking=True)` asynchronous.
The loader has its own random generator, so starting it draws nothing from the training's
(a resumed run's dropout stays the uninterrupted run's). Workers ignore SIGINT, SIGTERM and
SIGUSR1: the main process acts on them (a preemption saves a checkpoint) and the workers end
with it.

Failures never hang the consumer and never pass silently:

- a sample that cannot be read is that microbatch's result; `next()` raises it as one line,
  `DataError: train data: reading batch 3 microbatch 1 failed: IndexError: ...` (chained to
  the original). Microbatches read ahead past the point the run needs (the dataset's end, say)
  only fail if the consumer asks for them;
- a worker that dies is torch's RuntimeError, raised as one DataError line naming the loader.

Iterators that are not index-addressable (an in-memory `itertools.cycle`, say) are read in the
main process as they are.
"""
from __future__ import annotations

import itertools
import multiprocessing
import pickle
import signal
import time
from typing import Iterator

import torch
from torch.utils.data import DataLoader, Sampler

from megatron_2bw.data.errors import DataError

CUDA_NUM_WORKERS = 2  # Megatron's --num-workers


def num_workers_for(device, asked: int | None) -> int:
    """--num-workers, or its default: Megatron's 2 where CUDA is (the CPUs are free to read
    ahead), else 0 (the ranks' math uses the cores: workers would only take them away)."""
    if asked is not None:
        return asked
    return CUDA_NUM_WORKERS if torch.device(device).type == "cuda" else 0


class _Failure:
    """A microbatch that could not be read: the error (picklable) and its first line."""

    def __init__(self, error: BaseException):
        first = str(error).splitlines()[0] if str(error) else ""
        self.kind, self.first = type(error).__name__, first
        try:
            pickle.loads(pickle.dumps(error))  # it must cross the worker's queue
            self.error = error
        except Exception:  # noqa: BLE001 - an unpicklable error still comes back as its text
            self.error = RuntimeError(f"{self.kind}: {first}")


class _Microbatches(torch.utils.data.Dataset):
    """Microbatch k of a MicrobatchIterator, a failure as its result."""

    def __init__(self, batches):
        self.batches = batches

    def __getitem__(self, k: int):
        try:
            return self.batches.microbatch(k)
        except Exception as e:  # noqa: BLE001 - handed to the consumer, not lost
            return _Failure(e)


class _From(Sampler):
    """k, k + 1, k + 2, ...: the microbatches in schedule order from the k-th."""

    def __init__(self, first: int):
        self.first = first

    def __iter__(self):
        return itertools.count(self.first)


def _as_is(item):
    return item


# workers are forked where the system can (Linux: what Megatron's loader gets), whatever start
# method this process was made with: milliseconds each, and the dataset need not be picklable
_FORK = "fork" if "fork" in multiprocessing.get_all_start_methods() else None


def _worker_signals(_worker_id: int) -> None:
    for name in ("SIGINT", "SIGTERM", "SIGUSR1"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)


class Loader:
    def __init__(self, batches, name: str, num_workers: int, pin: bool = False,
                 prefetch: int = 2):
        if num_workers < 0:
            raise ValueError(f"num_workers {num_workers}: must be >= 0")
        self.name, self.num_workers, self.pin = name, num_workers, pin
        self._locate, self._next, self._done = batches.locate, batches.k, False
        loader = DataLoader(_Microbatches(batches), batch_size=None, sampler=_From(batches.k),
                            num_workers=num_workers, collate_fn=_as_is, pin_memory=pin,
                            persistent_workers=num_workers > 0,
                            prefetch_factor=prefetch if num_workers else None,
                            worker_init_fn=_worker_signals if num_workers else None,
                            multiprocessing_context=_FORK if num_workers else None,
                            generator=torch.Generator().manual_seed(0))
        self._it = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        where = "batch {} microbatch {}".format(*self._locate(self._next))
        try:
            item = next(self._it)
        except Exception as e:  # noqa: BLE001 - the loader's own failure (a worker died)
            dead = _dead_worker(self._it)  # before close(), which ends the others
            self.close()
            first = str(e).splitlines()[0] if str(e) else ""
            raise DataError(f"{self.name}: the loader failed before {where}{dead}: "
                            f"{type(e).__name__}: {first}") from e
        if isinstance(item, _Failure):
            self.close()
            raise DataError(f"{self.name}: reading {where} failed: {item.kind}: "
                            f"{item.first}") from item.error
        self._next += 1
        return item

    def close(self) -> None:
        """Stop the workers (the next `next()` ends the iteration)."""
        self._done = True
        shutdown = getattr(self._it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


def input_pipeline(iterator: Iterator, name: str, grid, device,
                   num_workers: int | None = None) -> Iterator:
    """A Loader of `num_workers` processes (None: `num_workers_for`'s default) over `iterator`
    on the ranks that read data (the first and the last pipeline stage), pinned when `device`
    is CUDA; elsewhere the iterator itself, which the engine never asks for anything (so those
    ranks start no workers and spend no work on data). An iterator without `microbatch(k)` is
    returned as it is."""
    if not (grid.is_first_stage or grid.is_last_stage) or not hasattr(iterator, "microbatch"):
        return iterator
    dataset = getattr(iterator, "dataset", None)
    if dataset is not None:
        name = f"{name} ({type(dataset).__name__})"
    return Loader(iterator, name, num_workers_for(device, num_workers),
                  pin=torch.device(device).type == "cuda")


def close_pipelines(*iterators) -> None:
    for it in iterators:
        if isinstance(it, Loader):
            it.close()


def _dead_worker(it, wait_s: float = 2.0) -> str:
    """", worker <pid> exited unexpectedly (killed by signal N | exit code N)" for the first
    worker process of a DataLoader iterator that is gone, else "" (the message can then only
    be the loader's own). Error path only: a worker killed while sending resets its pipe
    before its exit is visible, so this waits up to `wait_s` for one to be reaped."""
    workers = list(getattr(it, "_workers", ()))
    deadline = time.monotonic() + (wait_s if workers else 0.0)
    while True:
        for w in workers:
            if not w.is_alive():
                code = w.exitcode
                how = f"killed by signal {-code}" if code is not None and code < 0 else \
                    f"exit code {code}"
                return f", worker {w.pid} exited unexpectedly ({how})"
        if time.monotonic() >= deadline:
            return ""
        time.sleep(0.01)
