"""Failure handling of a training run: the launcher watch, preemption signals, failures named by
rank and stage, non-finite losses and gradients, and the fault-injection hooks tests pass in.

- Launcher watch: a worker that a launcher started (torchrun, srun, mpirun, torch
  multiprocessing) exits within about a second of that launcher's death (`kill -9` of torchrun,
  an unhandled SIGUSR1, a dead slurmstepd): no orphan keeps training or writing checkpoints.
- Preemption: SIGTERM, SIGUSR1 (SLURM's pre-timeout signal: the batch scripts take it as
  `#SBATCH --signal=B:USR1@300` and forward it to every worker, with torchrun ignoring it, then
  requeue: examples/slurm/preemption.sh) and SIGINT (Ctrl-C) set a flag (from the start of
  `training.train`, before the checkpoint is loaded); the flag rides in the next batch's
  gradient reductions (pipeline/flags.py), so two iterations later every rank agrees on the
  same boundary, where the run saves a checkpoint and exits 0. The next job resumes from it. A
  second Ctrl-C, a second or more after the first, aborts at once.
- Abort on Ctrl-C: training ranks handle SIGINT with `abort_on_sigint` (print one line, exit 130
  at once), not with KeyboardInterrupt: Python drops an exception that a signal raises inside a
  finalizer (a `__del__`, a weakref callback, a generator's close) after printing it, and the run
  would go on. Preemption's second Ctrl-C calls that handler.
- Failures: an exception on any rank is printed as one line naming the rank, stage, data and
  tensor coordinates, and the process exits non-zero, so the launcher (torchrun, srun
  --kill-on-bad-exit, torch.multiprocessing) stops the others; ranks blocked on a dead peer fail
  within the collective timeout (--distributed-timeout-minutes) with the peer named.
- Non-finite values (--check-for-nan-in-loss-and-grad, on by default): every rank reads the
  loss and the per-stage finiteness bits of the batch before the newest after each iteration
  (pipeline/flags.py: carried with the control flags, no extra collective, no wait for the batch
  just queued), and those of the newest before a checkpoint and at the end, so no checkpoint of a
  diverged step is written; `check_numerics` stops fp32/bf16 runs naming the iteration and the
  stages. fp16 skips such steps instead.
- Fault injection: `FaultHooks` (pipeline/faults.py, with `NumericsError`: the leaf that the
  engine and checkpoints share) is the set of points where tests inject faults. Production code
  calls the no-op defaults; tests pass their own object to `training.train(..., hooks=)` or
  `pretrain.main(family, argv, hooks=)`. Nothing here reads the environment to inject a fault.
"""
from __future__ import annotations

import math
import os
import signal
import threading
import time

from megatron_2bw.pipeline.faults import NumericsError

WATCHER = "megatron-2bw-launcher-watch"


def watch_launcher(poll_seconds: float = 1.0) -> None:
    """Exit this process within about `poll_seconds` of its parent's death (idempotent).

    Call it only in workers a launcher started: their parent (torchrun's agent, slurmstepd, the
    spawning process) lives as long as the job. When it dies the kernel re-parents the worker,
    os.getppid() changes, and the worker exits with one line on stderr. A daemon thread polls
    instead of prctl(PR_SET_PDEATHSIG), which fires when the *thread* that forked the worker
    exits and so kills workers of launchers that spawn from short-lived threads."""
    if any(t.name == WATCHER for t in threading.enumerate()):
        return
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_seconds)
        try:
            os.write(2, (f"error: worker pid {os.getpid()}: its launcher (pid {parent}) is gone; "
                         "exiting so that no orphan keeps training or writing checkpoints\n"
                         ).encode())
        finally:
            os._exit(1)

    threading.Thread(target=watch, name=WATCHER, daemon=True).start()


_IMPORTED_AT = time.time()  # the fallback of process_start_time: imported at start-up


def process_start_time() -> float:
    """When this process started, in time.time() seconds (what --exit-duration-in-mins counts
    from, as Megatron's does: start-up, index building and checkpoint loading included). Linux:
    /proc/self/stat's start time after boot plus /proc/stat's boot time (10 ms ticks); elsewhere
    when this module was first imported (pretrain imports it before parsing any flag)."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        ticks = int(stat[stat.rindex(")") + 2:].split()[19])  # field 22: starttime
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return min(boot + ticks / os.sysconf("SC_CLK_TCK"), _IMPORTED_AT)
    except (OSError, ValueError, StopIteration):
        return _IMPORTED_AT


def abort_on_sigint(line: str, code: int = 130):
    """From now on SIGINT prints `line` on stderr and exits `code` at once, whatever Python code
    the main thread is running (no exception that a finalizer could swallow, no atexit, no
    waiting on peers). Returns the previous handler for `signal.signal(SIGINT, previous)`; off the
    main thread signals are left alone and it returns None."""
    def abort(signum, frame) -> None:
        try:
            os.write(2, (line + "\n").encode())
        finally:
            os._exit(code)

    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGINT, abort)


_HELD: list[str] = []  # SIGUSR1s that came before a Preemption took over (hold_usr1)


def hold_usr1() -> None:
    """Keep a SIGUSR1 (SLURM's pre-timeout signal) that comes before training starts (flag
    parsing, index building, process-group set-up) instead of dying of it: the Preemption that
    training.train installs acts on it, so the run saves at its first agreed boundary.
    pretrain.main calls it first. Without --save no Preemption takes over and USR1 stays
    ignored. Off the main thread signals are left alone."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, lambda signum, frame: _HELD.append("SIGUSR1"))


class Preemption:
    """Catches SIGTERM/SIGUSR1/SIGINT and turns them into a checkpoint-and-exit at a safe point
    (also a SIGUSR1 held since start-up: hold_usr1)."""

    SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")
    ABORT_AFTER_S = 1.0  # torchrun forwards the terminal's Ctrl-C to workers that already got it

    def __init__(self):
        self.requested = False
        self.signal_name = None
        self._interrupted_at = None
        self._previous = {}
        for name in self.SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                try:
                    self._previous[sig] = signal.signal(sig, self._handle)
                except ValueError:  # not the main thread: leave signals alone
                    pass
        if _HELD:  # a SIGUSR1 came during start-up
            self.requested, self.signal_name = True, _HELD[0]
            _HELD.clear()

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT:
            now = time.monotonic()
            if self._interrupted_at is not None and now - self._interrupted_at >= \
                    self.ABORT_AFTER_S:  # the second Ctrl-C: abort without the checkpoint
                previous = self._previous.get(signum)
                if callable(previous):  # abort_on_sigint's handler, or Python's default
                    previous(signum, frame)
                raise KeyboardInterrupt
            self._interrupted_at = self._interrupted_at or now
        self.requested = True
        self.signal_name = self.signal_name or signal.Signals(signum).name

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


def check_numerics(numerics: tuple[int, float, list[int]] | None, grid, dtype: str,
                   last_checkpoint: str | None = None) -> None:
    """Raise NumericsError when the batch `numerics` describes (ControlFlags.numerics: the batch,
    its loss, the stages whose gradients were not finite) diverged, naming its iteration and
    those stages. Every rank reads the same values, so all raise at the same iteration (no
    hang). fp16 skips such steps instead (BatchStepper), so it is never checked here."""
    if numerics is None or dtype == "fp16":
        return
    batch, loss, stages = numerics
    if not stages and math.isfinite(loss):
        return
    names = ", ".join(map(str, stages))
    where = (f"the gradients of stage{'s' if len(stages) > 1 else ''} {names} (of "
             f"{grid.pipeline}) are not finite" if stages else "the gradients are finite")
    what = f"loss is {loss}" if not math.isfinite(loss) else "gradient norm is not finite"
    resume = f"resume from {last_checkpoint}" if last_checkpoint else \
        "resume from the last checkpoint"
    raise NumericsError(f"{what} at iteration {batch + 1} on {grid.describe()} with {dtype}: "
                        f"{where}; lower --lr, add --clip-grad, use --fp16 loss scaling, or "
                        f"{resume}")
