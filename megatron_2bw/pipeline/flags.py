"""Control flags: yes/no requests of single ranks (a preemption signal, the exit duration, an
asynchronous checkpoint write still in flight) that every rank must act on at the same iteration
boundary. They ride in the per-batch reductions that
already exist; no collective of their own.

Layout: the tail of every gradient buffer (weights.py) is [loss, *FLAGS]. At R(t) each rank
writes 1 into the slots of the flags it raises (the others stay 0: S zeroes the buffer). The
data-parallel all-reduce sums the tail over replicas, and N(t) carries it, behind norm^2, in the
model-parallel all-reduce, so after N(t) every rank of the world holds the same world-wide sums.
A flag is agreed when its sum is > 0. (A non-finite loss needs no slot: NaN and inf survive the
same sums, so every rank reads them in the loss.)

Reading without a host sync: after N(t) the sums are copied to the host without blocking (pinned
memory and a CUDA event on a GPU; the tensor itself on the CPU). After batch t the training loop
reads the flags of batch t-1, whose copy was queued before all of batch t's work and is therefore
done or nearly: the host never waits for the batch it just queued. Every rank reads the same batch
(the one before its newest; all ranks have run the same batches) and the same sums, so every rank
decides the same. Timing: a flag raised after batch t rides in batch t+1 and is acted on after
batch t+2.
"""
from __future__ import annotations

import torch

FLAGS = ("preempt", "exit_duration", "save_busy")


class ControlFlags:
    """This rank's raised flags (written at R) and the agreed ones (carried out of N)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.raised: set[str] = set()
        self._carried: dict[int, tuple] = {}   # batch -> (host values, CUDA event or None)
        self._latest: int | None = None
        cuda = self.device.type == "cuda"
        self._host = [torch.zeros(len(FLAGS), pin_memory=True) for _ in range(2)] if cuda \
            else None
        self._events = [torch.cuda.Event() for _ in range(2)] if cuda else None
        self._turn = 0  # which of the two host buffers the next batch's sums go to

    def raise_flag(self, name: str, on: bool = True) -> None:
        """Ask every rank to act on `name` (from the next R on, while it stays raised)."""
        if name not in FLAGS:
            raise ValueError(f"unknown control flag {name!r}: use one of {FLAGS}")
        (self.raised.add if on else self.raised.discard)(name)

    def write(self, tail: torch.Tensor) -> None:
        """R(t): mark the raised flags in the buffer's flag slots (device fills, no sync)."""
        for name in self.raised:
            i = FLAGS.index(name)
            tail[i:i + 1].fill_(1.0)

    def carried(self, batch: int, sums: torch.Tensor) -> None:
        """After N(t)'s wait: start moving batch t's agreed sums to the host."""
        if self._host is not None:
            # two host buffers in turn: batch t-1's copy stays readable while t's is queued
            host, event = self._host[self._turn], self._events[self._turn]
            self._turn = 1 - self._turn
            host.copy_(sums, non_blocking=True)
            event.record()
            self._carried[batch] = (host, event)
        else:
            self._carried[batch] = (sums, None)   # never written again: S makes new stats
        self._latest = batch
        self._carried.pop(batch - 2, None)

    def agreed(self) -> dict[str, bool]:
        """The flags every rank agreed on in the batch before the newest one (all False before
        two batches of this run have finished). Identical on every rank."""
        entry = None if self._latest is None else self._carried.get(self._latest - 1)
        if entry is None:
            return dict.fromkeys(FLAGS, False)
        host, event = entry
        if event is not None:
            event.synchronize()
        return {name: value > 0 for name, value in zip(FLAGS, host.tolist())}
