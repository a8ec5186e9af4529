"""Dropout randomness under tensor parallelism.

Dropout on replicated activations (after a row-parallel reduction) must draw the same mask on every
tensor rank: it uses the default generator, seeded identically across tensor ranks. Dropout inside
the parallel region (attention probabilities of this rank's heads) must differ across tensor ranks:
it runs under `tracker.fork()`, which swaps in a generator state seeded per tensor rank.
Recomputation saves and restores both (`get_states` / `set_states`).
"""
from __future__ import annotations

import contextlib

import torch

TP_SEED_OFFSET = 2718


def _device_state():
    return torch.cuda.get_rng_state() if torch.cuda.is_available() and \
        torch.cuda.is_initialized() else None


def _set_device_state(state) -> None:
    if state is not None:
        torch.cuda.set_rng_state(state)


class RNGTracker:
    def __init__(self, seed: int, tp_rank: int = 0):
        self.tp_rank = tp_rank
        self.reseed(seed)

    def reseed(self, seed: int) -> None:
        """Restart the tensor-parallel stream from `seed` (offset by this tensor rank). Only this
        tracker's saved states change; the process's generators are left alone. Lazy: the
        generator states are made when the stream is first used (`fork`, `get_states`), so a
        reseed per microbatch costs nothing while attention dropout is off."""
        self._value = seed + TP_SEED_OFFSET + self.tp_rank
        self._cpu = self._dev = None

    def _states(self) -> None:
        """Make the states of the pending reseed (once after each reseed)."""
        if self._cpu is not None:
            return
        self._cpu = torch.Generator().manual_seed(self._value).get_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            with torch.random.fork_rng(devices=[torch.cuda.current_device()]):
                torch.cuda.manual_seed(self._value)
                self._dev = torch.cuda.get_rng_state()

    def __deepcopy__(self, memo) -> "RNGTracker":
        return self  # one random stream per process, shared by the weight-version replicas

    @contextlib.contextmanager
    def fork(self):
        """Run the block with the tensor-parallel generator state, then advance it."""
        self._states()
        cpu, dev = torch.get_rng_state(), _device_state()
        torch.set_rng_state(self._cpu)
        if dev is not None and self._dev is not None:
            torch.cuda.set_rng_state(self._dev)
        try:
            yield
        finally:
            self._cpu = torch.get_rng_state()
            torch.set_rng_state(cpu)
            if dev is not None and self._dev is not None:
                self._dev = torch.cuda.get_rng_state()
                torch.cuda.set_rng_state(dev)

    def get_states(self):
        self._states()
        return (torch.get_rng_state(), _device_state(), self._cpu.clone(),
                None if self._dev is None else self._dev.clone())

    def set_states(self, states) -> None:
        cpu, dev, tcpu, tdev = states
        torch.set_rng_state(cpu)
        _set_device_state(dev)
        self._cpu = tcpu.clone()
        self._dev = None if tdev is None else tdev.clone()
