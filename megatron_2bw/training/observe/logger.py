"""Training logs: Megatron's console lines from the last pipeline stage (training/observe/
log_line.py), the same numbers to wandb and TensorBoard (training/observe/writers.py), a progress
bar on a terminal (training/observe/progress.py).

The writers get Megatron's tags as rows (iteration, consumed samples, {tag: value}) and the
scalars of the line's own fields (ETA and other text left out); Megatron's fields of the line are
not written under their line names, their tags carry them (interval_log.megatron_rows). Every
write goes to a step at or after the steps written before it (wandb drops a point logged to an
earlier step): the training loop hands each iteration's rows over before any evaluation at or
after it. What a training interval logs is assembled in `training/observe/interval_log.py`.
"""
from __future__ import annotations

from megatron_2bw.training.observe.log_line import (MEGATRON, format_interval, parse_line,
                                                    validation_lines)
from megatron_2bw.training.observe.writers import TensorBoardWriter, WandbWriter, scalars

__all__ = ["TrainLogger", "parse_line"]


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

    def rows(self, rows: list) -> None:
        """Megatron's tags to the writers, no line: [(iteration, samples, {tag: value})]."""
        if self.reporter:
            for writer in self.writers:
                writer.write_rows(rows)

    def log(self, iteration: int, fields: dict, tensorboard_only: dict | None = None,
            rows: list | None = None) -> None:
        """The interval line of `fields` (log_line.format_interval); to the writers `rows`
        (Megatron's tags) and the scalars of the line's own fields; TensorBoard also gets
        `tensorboard_only`'s (--log-timers-to-tensorboard without --wall-clock-breakdown)."""
        if not self.reporter:
            return
        if self.bar is not None:
            self.bar.show(fields)
        self._emit(format_interval(iteration, self.cfg.train.train_iters, fields))
        values = scalars({k: v for k, v in fields.items() if k not in MEGATRON})
        for writer in self.writers:
            extra = scalars(tensorboard_only or {}) if isinstance(writer, TensorBoardWriter) \
                else {}
            writer.write_rows(rows or [])
            writer.write(iteration, {**values, **extra})

    def validation(self, iteration: int, loss: float, ppl: float, rows: list,
                   on_validation_set: bool = False) -> None:
        """Megatron's validation line (with its dashed frame) and its rows to the writers."""
        if not self.reporter:
            return
        for line in validation_lines(iteration, loss, ppl, on_validation_set):
            self._emit(line)
        self.rows(rows)

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
