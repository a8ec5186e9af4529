"""Test-only fault injection: a pipeline.faults.FaultHooks that injects one fault on one rank at
one iteration. Production code never builds one; tests pass it to training.train(hooks=) or, for
launcher tests, through tests/fault_entry.py (--inject KIND:RANK:ITERATION).

Kinds: kill (SIGKILL itself after that iteration), sigterm / sigint (signal itself there),
raise (a RuntimeError there), freeze (SIGSTOP itself there: a frozen rank whose sockets stay
open, so its peers see no death, only silence), kill-in-save (die halfway through writing that
iteration's checkpoint, leaving a temporary file), nan (poison the loss from that iteration on the last stage).
SlowStage and PoisonGradient (below) make a straggler and a non-finite gradient on one stage."""
from __future__ import annotations

import os
import signal
import time

from megatron_2bw.checkpoint.files import TMP_PREFIX
from megatron_2bw.pipeline.faults import FaultHooks

KINDS = ("kill", "sigterm", "sigint", "raise", "freeze", "kill-in-save", "nan")


class InjectedFault(FaultHooks):
    def __init__(self, kind: str, rank: int, iteration: int):
        assert kind in KINDS, kind
        self.kind, self.rank, self.iteration = kind, rank, iteration

    @classmethod
    def parse(cls, spec: str) -> "InjectedFault":
        kind, rank, it = spec.split(":")
        return cls(kind, int(rank), int(it))

    def _here(self, kind: str, grid, iteration: int) -> bool:
        return self.kind == kind and grid.rank == self.rank and iteration == self.iteration

    def after_iteration(self, grid, iteration: int) -> None:
        if self._here("kill", grid, iteration):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._here("sigterm", grid, iteration):  # as if SLURM/torchrun signalled this rank
            os.kill(os.getpid(), signal.SIGTERM)
        if self._here("sigint", grid, iteration):
            os.kill(os.getpid(), signal.SIGINT)
        if self._here("freeze", grid, iteration):
            os.kill(os.getpid(), signal.SIGSTOP)
        if self._here("raise", grid, iteration):
            raise RuntimeError(f"injected failure at iteration {iteration}")

    def during_save(self, grid, iteration: int, path: str) -> None:
        if self._here("kill-in-save", grid, iteration):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(os.path.join(os.path.dirname(path), TMP_PREFIX + "partial"), "wb") as f:
                f.write(b"PK\x03\x04 half a checkpoint")
            os.kill(os.getpid(), signal.SIGKILL)

    def wrap_loss(self, loss_fn, engine):
        if self.kind != "nan" or engine.grid.rank != self.rank:
            return loss_fn
        target = self.iteration

        def poisoned(out, labels):  # engine.iteration: optimizer steps done in this window
            loss = loss_fn(out, labels)
            return loss * float("nan") if engine.iteration + 1 >= target else loss
        return poisoned


class SlowStage(FaultHooks):
    """Rank `rank` sleeps `seconds` in every forward from iteration `iteration` on: a straggler
    (a forward pre-hook on each of the stage's weight-version modules)."""

    def __init__(self, rank: int, iteration: int, seconds: float):
        self.rank, self.iteration, self.seconds = rank, iteration, seconds

    def on_engine(self, engine):
        if engine.grid.rank != self.rank:
            return

        def sleep(module, args):  # engine.iteration: optimizer steps done in this window
            if engine.iteration + 1 >= self.iteration:
                time.sleep(self.seconds)
        for module in engine.weights.modules:
            module.register_forward_pre_hook(sleep)


class PoisonGradient(FaultHooks):
    """Rank `rank`'s gradient of batch `iteration` (1-based) gets `value` in its last element
    (a parameter of its own stage, never the tied embedding) before each of its backwards of
    that batch, so the backwards add into it and the reduction (whose buckets start during the
    last of them, pipeline/grad_reduce.py) carries it: a non-finite gradient on one stage,
    whatever the schedule runs in that iteration's window."""

    def __init__(self, rank: int, iteration: int, value: float = float("nan")):
        self.rank, self.iteration, self.value = rank, iteration, value

    def on_engine(self, engine):
        if engine.grid.rank != self.rank:
            return
        reduction = engine.stepper.reduction
        before = reduction.before_backward

        def poisoned(batch, slot):
            if batch + 1 == self.iteration:
                engine.weights.grads[slot][engine.weights.numel - 1] = self.value
            before(batch, slot)
        reduction.before_backward = poisoned


class SlowIterations(FaultHooks):
    """Every iteration takes about `seconds` longer: rank 0 sleeps that long inside the first
    forward of each iteration (the other ranks wait on it in their receives and reductions), and
    says so on stderr first ("slow iteration N: ..."), so a test can send a signal mid-iteration.
    For the preemption tests (tests/e2e/test_slurm_preemption.py)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_engine(self, engine):
        if engine.grid.rank != 0:
            return
        slept = set()

        def sleep(module, args):  # engine.iteration: optimizer steps done so far
            if engine.iteration not in slept:
                slept.add(engine.iteration)
                os.write(2, f"slow iteration {engine.iteration + 1}: sleeping {self.seconds} s "
                            "in its first forward\n".encode())
                time.sleep(self.seconds)
        for module in engine.weights.modules:
            module.register_forward_pre_hook(sleep)


class SlowStart(FaultHooks):
    """Start-up takes `seconds` longer: every rank sleeps once the engine is built, before the
    checkpoint is loaded and the training loop starts (like a long index build or load)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_engine(self, engine):
        time.sleep(self.seconds)
