"""Reading microbatches ahead of the training loop, in a background thread.

    data = Prefetcher(GPTBatches(...), name="train data", pin=device.type == "cuda")
    inputs, labels = next(data)   # the same microbatches, in the same order, as the iterator
    data.close()

One daemon thread calls `next()` on the wrapped iterator (the dataset reads and the stacking
happen there; numpy and torch release the GIL while they copy) and puts each microbatch into a
bounded queue of `depth` items, so at most `depth` microbatches are read ahead. With `pin` the
tensors are moved to page-locked memory in the thread, which makes the engine's
`.to(device, non_blocking=True)` a truly asynchronous host-to-device copy.

Failures never hang the consumer and never pass silently:

- an exception in the worker takes that microbatch's place in the queue; `next()` raises it as
  one line, `DataError: train data: reading batch 3 microbatch 1 failed: IndexError: ...`
  (chained to the original). Microbatches read ahead past the point the run needs (the dataset's
  end, say) only fail if the consumer asks for them;
- the iterator's end (StopIteration) ends this iterator at the same place;
- a worker that is gone without a word (killed with the interpreter) is noticed within
  `poll_s`: `next()` raises instead of waiting forever.
"""
from __future__ import annotations

import queue
import threading
from typing import Iterator

import torch

from megatron_2bw.data.errors import DataError

_END = object()


class _Failure:
    def __init__(self, error: BaseException, where: str):
        self.error, self.where = error, where


def pin(obj):
    """obj with every tensor in page-locked memory (tuples, lists and dicts recursively)."""
    if isinstance(obj, torch.Tensor):
        return obj.pin_memory()
    if isinstance(obj, (tuple, list)):
        return type(obj)(pin(o) for o in obj)
    if isinstance(obj, dict):
        return {k: pin(v) for k, v in obj.items()}
    return obj


def _where(it, count: int) -> str:
    """Which microbatch comes next: the iterator's own words when it has them."""
    position = getattr(it, "next_microbatch", None)
    if position is not None:
        return "batch {} microbatch {}".format(*position)
    return f"item {count} of the iterator"


class Prefetcher:
    def __init__(self, iterator: Iterator, name: str = "data", depth: int = 4, pin: bool = False,
                 poll_s: float = 1.0):
        if depth < 1:
            raise ValueError(f"prefetch depth {depth}: must be >= 1")
        self.name, self._poll = name, poll_s
        self._it, self._pin = iterator, pin
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._work, name=f"prefetch {name}", daemon=True)
        self._thread.start()

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        while True:
            try:
                item = self._queue.get(timeout=self._poll)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self._done = True
                    raise DataError(f"{self.name}: the prefetch thread stopped without a "
                                    "result: rerun; if it persists, report it") from None
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, _Failure):
            self._done = True
            e = item.error
            first = str(e).splitlines()[0] if str(e) else ""
            raise DataError(f"{self.name}: reading {item.where} failed: {type(e).__name__}: "
                            f"{first}") from e
        return item

    def close(self) -> None:
        """Stop reading ahead (the thread exits within poll_s; the wrapped iterator is left
        where the thread stopped)."""
        self._stop.set()
        self._done = True
        self._thread.join(timeout=5 * self._poll)

    # -- the worker thread ------------------------------------------------------------------------
    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=self._poll)
                return True
            except queue.Full:
                continue
        return False

    def _work(self) -> None:
        count = 0
        while not self._stop.is_set():
            where = _where(self._it, count)
            try:
                item = next(self._it)
                if self._pin:
                    item = pin(item)
            except StopIteration:
                self._put(_END)
                return
            except BaseException as e:  # noqa: BLE001 - handed to the consumer, not lost
                self._put(_Failure(e, where))
                return
            if not self._put(item):
                return
            count += 1


def input_pipeline(iterator: Iterator, name: str, grid, device, depth: int = 4) -> Iterator:
    """A Prefetcher over `iterator` on the ranks that read data (the first and the last pipeline
    stage), pinned when `device` is CUDA; elsewhere the iterator itself, which the engine never
    asks for anything (so those ranks spend no work on data)."""
    if not (grid.is_first_stage or grid.is_last_stage):
        return iterator
    dataset = getattr(iterator, "dataset", None)
    if dataset is not None:
        name = f"{name} ({type(dataset).__name__})"
    return Prefetcher(iterator, name, depth, pin=torch.device(device).type == "cuda")


def close_pipelines(*iterators) -> None:
    for it in iterators:
        if isinstance(it, Prefetcher):
            it.close()
