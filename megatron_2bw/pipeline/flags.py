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

Numerics: N(t) appends one slot per pipeline stage to the model-parallel all-reduce, 1 on the
ranks of stage s whose share of the squared gradient norm is not finite. The gradients were
reduced over replicas (and the tied slice over the first and last stage) before N, so every
replica computes the same bits and, after the sum, slot s > 0 on every rank exactly when stage
s's gradients are not finite (a tied gradient counts on the first stage, as in the norm). The
carried vector of batch t is therefore

    [loss, *FLAGS, *stage_nonfinite(d)]      (`numerics()` reads the first and the last d)

and is read like the flags, one batch late without waiting (`numerics()`), or for the newest
batch, waiting for it (`numerics(newest=True)`: before a checkpoint, never per batch).

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

from megatron_2bw.config.control_flags import FLAGS  # noqa: F401 (torch-free, for the planner)


class ControlFlags:
    """This rank's raised flags (written at R) and the agreed ones (carried out of N), with the
    loss and the per-stage finiteness of the gradients (see the module docstring)."""

    def __init__(self, device, num_stages: int = 1):
        self.device = torch.device(device)
        self.num_stages = num_stages
        self.raised: set[str] = set()
        self._carried: dict[int, tuple] = {}   # batch -> (host values, CUDA event or None)
        self._latest: int | None = None
        cuda = self.device.type == "cuda"
        size = 1 + len(FLAGS) + num_stages
        self._host = [torch.zeros(size, pin_memory=True) for _ in range(2)] if cuda else None
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
        """After N(t)'s wait: start moving batch t's [loss, *flag sums, *stage bits] to the
        host."""
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
        values = self._read(False)
        if values is None:
            return dict.fromkeys(FLAGS, False)
        return {name: value > 0 for name, value in zip(FLAGS, values[1][1:])}

    def numerics(self, newest: bool = False) -> tuple[int, float, list[int]] | None:
        """(batch, its loss, the stages whose gradients were not finite) of the batch before the
        newest one (without waiting), or of the newest (`newest`: waits for its reductions);
        None before such a batch has run. Identical on every rank."""
        values = self._read(newest)
        if values is None:
            return None
        batch, host = values
        bits = host[len(host) - self.num_stages:]
        return batch, host[0], [s for s, bit in enumerate(bits) if bit != 0]

    def _read(self, newest: bool) -> tuple[int, list[float]] | None:
        if self._latest is None:
            return None
        batch = self._latest if newest else self._latest - 1
        entry = self._carried.get(batch)
        if entry is None:
            return None
        host, event = entry
        if event is not None:
            event.synchronize()
        return batch, host.tolist()
