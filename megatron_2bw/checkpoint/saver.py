"""When the training loop's saves happen and how they end: `Checkpointer`.

    saver = Checkpointer(cfg, grid, engine, hooks)
    for it in ...:
        engine.train_batch(data)
        saver.poll()                    # publishes a finished --async-save (no collective
                                        # unless it is time)
        if save_point: saver.save(wait=last)
    saver.wait()                        # at the end: the save in flight is published

Synchronous saves (--ckpt-format torch, or torch_dist without --async-save) are done when
`save` returns. With --async-save, `save` returns once the state is on the host and the write has
started; a second save, the end of training and a preemption first wait for the one in flight
(`wait`). In between, `poll` publishes it at the first iteration boundary where every rank's
write is done: each rank raises the `save_busy` control flag while its write thread runs; the
flag rides in the next batch's reductions (pipeline/flags.py), so every rank reads the same
verdict at the same boundary and calls the collective `finish` together. The verdict read after
batch k covers batch k-1, whose flags were set after the save started only from the third
boundary after it on, hence `iteration >= started + 3`.
"""
from __future__ import annotations

import time

from megatron_2bw.checkpoint.api import save_checkpoint, start_checkpoint
from megatron_2bw.config import Config
from megatron_2bw.pipeline.faults import NO_FAULTS, FaultHooks

FLAG = "save_busy"
AGREEMENT_DELAY = 3  # boundaries after a save starts before `save_busy` speaks about it


class Checkpointer:
    def __init__(self, cfg: Config, grid, engine, hooks: FaultHooks = NO_FAULTS, log=None,
                 beside: dict[str, bytes] | None = None):
        """`log`: where a published --async-save is announced (the reporting rank's log).
        `beside`: the files every save publishes beside its iterations (the tokenizer)."""
        self.cfg, self.grid, self.engine, self.hooks, self.log = cfg, grid, engine, hooks, log
        self.beside = beside
        self.train = cfg.train
        self.view = None
        if self.train.ckpt_format in ("torch_dist", "megatron"):  # both on DCP
            from megatron_2bw.checkpoint.dist.load import stage_boxes
            self.view = stage_boxes(engine, cfg, grid)
        self.pending, self.started, self.clock = None, None, 0.0

    @property
    def flags(self):
        return self.engine.stepper.flags

    def save(self, wait: bool = False) -> None:
        """Save the current iteration (collective); with --async-save, return once the state is
        on the host unless `wait`."""
        self.wait()  # a second save waits for the first
        t = self.train
        self.clock = time.time()
        if self.log is not None:  # Megatron's lines (the reporting rank)
            self.log(f"saving checkpoint at iteration {self.engine.iteration} to {t.save}")
        if not t.async_save:
            save_checkpoint(t.save, self.engine, self.cfg, self.grid, t.save_optim, t.keep_last,
                            self.hooks, view=self.view, beside=self.beside)
            if self.log is not None:
                self.log(f"successfully saved checkpoint at iteration {self.engine.iteration} "
                         f"to {t.save} ({time.time() - self.clock:.2f} s)")
            return
        self.pending = start_checkpoint(t.save, self.engine, self.cfg, self.grid, self.view,
                                        t.save_optim, t.keep_last, self.hooks, asynchronous=True,
                                        beside=self.beside)
        self.started = self.engine.iteration
        self.flags.raise_flag(FLAG)
        if wait:
            self.wait()

    def poll(self) -> None:
        """At an iteration boundary: publish the save in flight once every rank has written it
        (the same boundary on every rank)."""
        if self.pending is None:
            return
        self.flags.raise_flag(FLAG, self.pending.writing)
        if self.engine.iteration >= self.started + AGREEMENT_DELAY and \
                not self.flags.agreed()[FLAG]:
            self.wait()

    def wait(self) -> None:
        """Collective: wait for the save in flight, if any, and publish it."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        self.flags.raise_flag(FLAG, False)
        path = pending.finish()
        if self.log is not None:
            self.log(f"successfully saved checkpoint at iteration {pending.iteration} to "
                     f"{self.train.save} ({time.time() - self.clock:.2f} s)")
            self.log(f"saved iteration {pending.iteration} in {path}: written in the background "
                     f"while training went on, published at iteration {self.engine.iteration}")
