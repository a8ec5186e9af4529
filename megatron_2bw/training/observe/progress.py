"""Where a run stands: milliseconds per iteration, the ETA to --train-iters (--train-samples is
turned into iterations by the config), and a progress bar on a terminal.

`Pace` measures host wall-clock time between log intervals (nothing is synchronized for it: the
log interval's loss read already waits for the device). The ETA is the iterations left times the
mean time per iteration since the end of the run's first log interval, which holds the one-time
warm-up (pipeline fill, allocator growth, compilation); until a second interval ends it uses the
first. Evaluations and checkpoints between log intervals count, as they will in the rest of the
run.

`ProgressBar` is a tqdm bar on the last stage's terminal: the pretrain scripts show it when stdout
is a terminal and print only the plain log lines otherwise (SLURM logs, pipes, files). The log
lines still appear above the bar.
"""
from __future__ import annotations

import time


def format_duration(seconds: float) -> str:
    """'2d03h', '3h04m', '4m05s', '6s'."""
    s = max(int(round(seconds)), 0)
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{s:02d}s"
    return f"{s}s"


class Pace:
    def __init__(self, train_iters: int, clock=time.monotonic):
        self.train_iters, self.clock = train_iters, clock
        self.tick = clock()
        self._after_first = None   # (iteration, time) at the end of the first interval

    def interval(self, iteration: int, iterations: int) -> tuple[float, float]:
        """(seconds of the interval that ends after `iteration`, `iterations` long; ETA in
        seconds) and start the next interval."""
        now = self.clock()
        seconds, self.tick = now - self.tick, now
        per_iteration = seconds / max(iterations, 1)
        if self._after_first is None:
            self._after_first = (iteration, now)
        elif iteration > self._after_first[0]:
            it0, t0 = self._after_first
            per_iteration = (now - t0) / (iteration - it0)
        return seconds, per_iteration * max(self.train_iters - iteration, 0)


class ProgressBar:
    """A tqdm bar from `start` to `total` iterations on `stream` (a terminal)."""

    def __init__(self, stream, start: int, total: int):
        from tqdm import tqdm
        self.bar = tqdm(total=total, initial=start, file=stream, unit="it", desc="training",
                        dynamic_ncols=True, leave=True)

    def step(self, iteration: int) -> None:
        self.bar.update(iteration - self.bar.n)

    def show(self, metrics: dict) -> None:
        """The newest loss and lr next to the bar."""
        shown = {name: f"{metrics[k]:.4g}" for k, name in (("lm loss", "lm loss"),
                                                           ("learning rate", "lr"))
                 if k in metrics}
        if shown:
            self.bar.set_postfix(shown, refresh=False)

    def write(self, print_fn, line: str) -> None:
        """Print a log line above the bar."""
        self.bar.clear()
        print_fn(line)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()
