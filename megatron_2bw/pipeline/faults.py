"""The leaf of failure handling that the engine, checkpoints and training share: the error of a run
that diverged (`NumericsError`) and the points where tests inject faults (`FaultHooks`;
production code calls the no-op `NO_FAULTS`). No torch, nothing of the package: the handling
itself (launcher watch, preemption, the non-finite stop) is training/reliability.py's, and a
failing rank is named by its grid (`ProcessGrid.describe`).
"""
from __future__ import annotations

from typing import Callable


class NumericsError(RuntimeError):
    """A run that diverged: a non-finite loss without loss scaling, too many consecutive
    skipped fp16 steps, or non-finite weights at a checkpoint."""


class FaultHooks:
    """The points where tests inject faults; every default does nothing.

    after_iteration(grid, iteration)     after each training iteration (1-based), on every rank
    during_save(grid, iteration, path)   on each writing rank, before it writes `path`
    wrap_loss(loss_fn, engine)           once per engine: the loss function the engine uses
    on_engine(engine)                    once per engine, before training: tests register torch
                                         module or gradient hooks on `engine.weights.modules`
                                         (a stage that sleeps, a gradient made non-finite)
    """

    def after_iteration(self, grid, iteration: int) -> None:
        pass

    def during_save(self, grid, iteration: int, path: str) -> None:
        pass

    def wrap_loss(self, loss_fn: Callable, engine) -> Callable:
        return loss_fn

    def on_engine(self, engine) -> None:
        pass


NO_FAULTS = FaultHooks()


__all__ = ["NumericsError", "FaultHooks", "NO_FAULTS"]
