"""Failure handling of a training run: preemption signals, failures named by rank and stage,
non-finite losses, and a fault-injection hook for tests.

- Preemption: SIGTERM and SIGUSR1 (SLURM's pre-timeout signal, `#SBATCH --signal=USR1@300`) set a
  flag; the flag rides in the next batch's gradient reductions (pipeline/flags.py), so two
  iterations later every rank agrees on the same boundary, where the run saves a checkpoint and
  exits 0. The next job resumes from it.
- Failures: an exception on any rank is printed as one line naming the rank, stage, data and
  tensor coordinates, and the process exits non-zero, so the launcher (torchrun, srun
  --kill-on-bad-exit, torch.multiprocessing) stops the others; ranks blocked on a dead peer fail
  within the collective timeout (--distributed-timeout-minutes) with the peer named.
- Fault injection (tests only): MEGATRON_2BW_FAULT="kind:rank:iteration" with kind in
  kill (SIGKILL itself after that iteration), raise, sigterm (signal itself), kill-in-save (die
  halfway through writing the checkpoint of that iteration), nan (poison the loss there).
"""
from __future__ import annotations

import math
import os
import signal

FAULT_ENV = "MEGATRON_2BW_FAULT"


class NumericsError(RuntimeError):
    """A non-finite loss or gradient in a run without loss scaling."""


def describe(grid) -> str:
    return (f"rank {grid.rank} (stage {grid.stage}/{grid.pipeline}, data-parallel replica "
            f"{grid.dp_rank}, tensor rank {grid.tp_rank})")


class Preemption:
    """Catches SIGTERM/SIGUSR1 and turns them into a checkpoint-and-exit at a safe point."""

    SIGNALS = ("SIGTERM", "SIGUSR1")

    def __init__(self):
        self.requested = False
        self.signal_name = None
        self._previous = {}
        for name in self.SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                try:
                    self._previous[sig] = signal.signal(sig, self._handle)
                except ValueError:  # not the main thread: leave signals alone
                    pass

    def _handle(self, signum, frame) -> None:
        self.requested = True
        self.signal_name = signal.Signals(signum).name

    def agreed(self, engine) -> bool:
        """Call at every iteration boundary: raises this rank's request into the engine's next
        batch and returns True, on every rank at the same boundary, once any rank's request has
        ridden through a batch's reductions (pipeline/flags.py). No collective of its own."""
        flags = engine.stepper.flags
        flags.raise_flag("preempt", self.requested)
        return flags.agreed()["preempt"]

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def injected_fault(kind: str, grid, iteration: int) -> bool:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return False
    want, rank, it = spec.split(":")
    return want == kind and int(rank) == grid.rank and int(it) == iteration


def maybe_inject(grid, iteration: int) -> None:
    """Fault-injection hook called after each training iteration (no-op unless the env says)."""
    if injected_fault("kill", grid, iteration):
        os.kill(os.getpid(), signal.SIGKILL)
    if injected_fault("sigterm", grid, iteration):  # as if SLURM/torchrun signalled this rank
        os.kill(os.getpid(), signal.SIGTERM)
    if injected_fault("raise", grid, iteration):
        raise RuntimeError(f"injected failure at iteration {iteration}")


def check_finite(values: list[float], first_iteration: int, grid, dtype: str) -> None:
    """Collective: raise NumericsError naming the first bad iteration and the stages whose
    gradients were not finite (fp16 skips such steps instead, so it never gets here)."""
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    if not bad:
        return
    it = first_iteration + bad[0]
    raise NumericsError(f"loss is {values[bad[0]]} at iteration {it} on {describe(grid)} with "
                        f"{dtype}: lower --lr, add --clip-grad, use --fp16 loss scaling, or "
                        "resume from the last checkpoint")
