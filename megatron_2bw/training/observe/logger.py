"""Training logs: one console line per log interval from the last pipeline stage, the same numbers
to wandb and TensorBoard (training/observe/writers.py), a progress bar on a terminal
(training/observe/progress.py).

A line is `iteration   N/T | key value | key value ...`: numbers as written by `TrainLogger.log`
(lr in scientific notation, other floats to 4 significant digits, per-stage lists in brackets),
text as is (the ETA); `parse_line` reads it back. What a training interval logs is assembled in
`training/observe/interval_log.py`.
"""
from __future__ import annotations

import re

from megatron_2bw.training.observe.writers import TensorBoardWriter, WandbWriter, scalars

# line fields the writers get under Megatron's tags instead (interval_log.megatron_rows)
MEGATRON_TAGGED = ("lm loss", "lr", "decoupled lr", "grad norm", "params norm", "loss scale",
                   "validation loss", "validation ppl")


class TrainLogger:
    """Prints and writes on the reporting rank (`reporter`); every other rank's calls return at
    once. `progress` is a stream (a terminal) for the progress bar, or None for plain lines;
    `start` is the iteration the run starts from."""

    def __init__(self, cfg, grid, reporter: bool, print_fn=print, progress=None, start: int = 0):
        self.cfg, self.reporter, self.print = cfg, reporter, print_fn
        self.writers, self.bar = [], None
        if not reporter:
            return
        t = cfg.train
        if t.wandb_project:
            self.writers.append(WandbWriter(cfg))
        if t.tensorboard_dir:
            self.writers.append(TensorBoardWriter(cfg))
        if progress is not None:
            from megatron_2bw.training.observe.progress import ProgressBar
            self.bar = ProgressBar(progress, start, t.train_iters)

    def step(self, iteration: int) -> None:
        """After every iteration: move the progress bar (host only, rate-limited by tqdm)."""
        if self.bar is not None:
            self.bar.step(iteration)

    def log(self, iteration: int, metrics: dict, tensorboard_only: dict | None = None,
            rows: list | None = None) -> None:
        """One line of `metrics`; to the writers Megatron's tags (`rows`: [(iteration, samples,
        {tag: value})], interval_log.py) and the line's other scalars; TensorBoard also gets
        `tensorboard_only`'s (--log-timers-to-tensorboard without --wall-clock-breakdown)."""
        if not self.reporter:
            return
        if self.bar is not None:
            self.bar.show(metrics)
        self._emit(format_line(iteration, self.cfg.train.train_iters, metrics))
        values = scalars({k: v for k, v in metrics.items() if k not in MEGATRON_TAGGED})
        for writer in self.writers:
            extra = scalars(tensorboard_only or {}) if isinstance(writer, TensorBoardWriter) \
                else {}
            writer.write_rows(rows or [])
            writer.write(iteration, {**values, **extra})

    def note(self, line: str) -> None:
        """A line of its own (a straggler, a warning) on the reporting rank."""
        if self.reporter:
            self._emit(line)

    def _emit(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(self.print, line)  # above the bar
        else:
            self.print(line)

    def finish(self) -> None:
        for writer in self.writers:
            writer.close()
        self.writers = []
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def format_line(iteration: int, train_iters: int, metrics: dict) -> str:
    fields = [f"iteration {iteration:6d}/{train_iters}"]
    for key, value in metrics.items():
        if isinstance(value, float):
            value = f"{value:.3e}" if key in ("lr", "decoupled lr") else f"{value:.4g}"
        elif isinstance(value, list):
            value = "[" + ", ".join(f"{v:.2f}" for v in value) + "]"
        fields.append(f"{key} {value}")
    return " | ".join(fields)


def parse_line(line: str) -> tuple[int, dict] | None:
    """(iteration, {key: value}) of a line `TrainLogger.log` printed (numbers as floats, lists
    as lists of floats, anything else as text); None for any other line."""
    m = re.match(r"\s*iteration\s+(\d+)/\d+ \| (.*)$", line)
    if not m:
        return None
    fields = {}
    for part in m.group(2).split(" | "):
        kv = re.match(r"(.*?) (\[.*\]|\S+)$", part.strip())
        if kv:
            key, value = kv.groups()
            fields[key] = ([float(x) for x in value.strip("[]").split(",") if x.strip()]
                           if value.startswith("[") else _number(value))
    return int(m.group(1)), fields


def _number(text: str):
    try:
        return float(text)
    except ValueError:
        return text
