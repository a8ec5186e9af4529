"""What the training loop logs at each log interval and evaluation (the fields, in line order):

    consumed samples, ms/iteration, ETA            training/observe/progress.py (host wall clock,
                                                   no sync)
    lr, loss, grad norm, loss scale, skipped       the engine (read once per interval)
    samples/s, tokens/s, TFLOP/s/device            Megatron's model FLOPs (models/flops.py)
    memory GB per stage [, reserved GB per stage]  training/observe/memory.py (peaks of the
                                                   interval)
    ms <action> ...                                --wall-clock-breakdown (pipeline/timers.py)
    compute/wait ms per stage, slowest rank ...    --log-straggler (training/observe/straggler.py)
    validation loss, validation ppl                each --eval-interval (ppl = exp(min(loss, 20)))

`interval` is collective (memory and straggler tables are gathered from every rank) and is
called on every rank; only the reporting rank prints and writes (training/observe/logger.py). The
engine's timers are read and cleared here, once per interval, whenever the engine times its actions
(`TrainConfig.times_actions`); with --log-timers-to-tensorboard alone they go to TensorBoard only.
"""
from __future__ import annotations

import math

from megatron_2bw.training.observe.logger import TrainLogger
from megatron_2bw.training.observe.memory import memory_per_stage
from megatron_2bw.training.observe.progress import Pace, format_duration
from megatron_2bw.training.observe.straggler import rank_times, straggler_report

PPL_CAP = 20.0  # Megatron's: exp(min(20, loss))


def flops_per_sample(cfg) -> float:
    try:
        from megatron_2bw.models.flops import model_flops_per_sample
        return float(model_flops_per_sample(cfg.model,
                                            recompute=cfg.model.full_recompute))
    except Exception:  # noqa: BLE001 - logging must not fail on an estimate
        return 0.0


class IntervalLog:
    def __init__(self, cfg, grid, device, engine, logger: TrainLogger):
        self.cfg, self.grid, self.device, self.engine, self.logger = \
            cfg, grid, device, engine, logger
        self.pace = Pace(cfg.train.train_iters)
        self.flops = flops_per_sample(cfg)
        self.first = True   # the run's first interval holds the warm-up

    def interval(self, iteration: int, losses: list[float]) -> None:
        """Log the interval that ends after `iteration` (`losses`: one per iteration of it)."""
        cfg, t, engine, grid = self.cfg, self.cfg.train, self.engine, self.grid
        n = len(losses)
        seconds, eta = self.pace.interval(iteration, n)
        rate = cfg.batch.global_batch_size * n / max(seconds, 1e-9)
        metrics = {"consumed samples": cfg.batch.global_batch_size * iteration,
                   "ms/iteration": 1e3 * seconds / max(n, 1), "ETA": format_duration(eta),
                   "lr": engine.stepper.last_lr, "loss": losses[-1],
                   "grad norm": float(engine.last_grad_norm),
                   "loss scale": engine.stepper.scaler.scale,
                   "skipped": engine.skipped_iterations, "samples/s": rate,
                   "tokens/s": rate * cfg.model.seq_length,
                   "TFLOP/s/device": rate * self.flops / grid.world_size / 1e12,
                   **memory_per_stage(grid, self.device)}
        timers, straggler = {}, None
        if t.times_actions:
            totals = dict(engine.timers)
            engine.timers.clear()
            timers = {f"ms {k}": 1e3 * v / max(n, 1) for k, v in totals.items()}
            if t.log_straggler:
                rows = grid.comm.gather_floats(rank_times(totals, n))
                fields, straggler = straggler_report(rows, grid, t.straggler_threshold,
                                                     iteration, name=not self.first)
                metrics.update(fields)
        if t.wall_clock_breakdown:
            metrics.update(timers)
        self.logger.log(iteration, metrics,
                        timers if t.log_timers_to_tensorboard and not t.wall_clock_breakdown
                        else None)
        if straggler is not None:
            self.logger.note(straggler)
        self.first = False

    def validation(self, iteration: int, loss: float) -> None:
        self.logger.log(iteration, {"validation loss": loss,
                                    "validation ppl": math.exp(min(loss, PPL_CAP))})
