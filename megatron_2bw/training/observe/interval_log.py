"""What the training loop logs at each log interval and evaluation (the fields, in line order):

    consumed samples, ms/iteration, ETA            training/observe/progress.py (host wall clock,
                                                   no sync)
    lr [, decoupled lr], lm loss, grad norm        the engine (read once per interval; params
    [, params norm], loss scale, skipped           norm: --log-params-norm, a collective; the
                                                   decoupled lr: --decoupled-lr); lm loss
                                                   is the mean over the interval's iterations,
                                                   skipped fp16 steps left out (Megatron's)
    samples/s, tokens/s, TFLOP/s/device            Megatron's model FLOPs (models/flops.py)
    memory GB per stage [, reserved GB per stage]  training/observe/memory.py (peaks of the
                                                   interval)
    ms <action> ...                                --wall-clock-breakdown (pipeline/timers.py)
    compute/wait ms per stage, slowest rank ...    --log-straggler (training/observe/straggler.py)
    validation loss, validation ppl                each --eval-interval (ppl = exp(min(loss, 20)))

TensorBoard and wandb get Megatron's tags besides (`megatron_rows`): per iteration (every
--tensorboard-log-interval) `lm loss`, `learning-rate`, `batch-size`; per interval `grad-norm`,
`loss-scale`, `iteration-time` (seconds), `throughput` (TFLOP/s/device, always); per
evaluation `lm loss validation` and `lm loss validation ppl`; TensorBoard also each as
`<tag> vs samples` (training/observe/writers.py). `summary` is the run's last line.

`interval` is collective (memory and straggler tables are gathered from every rank) and is
called on every rank; only the reporting rank prints and writes (training/observe/logger.py). The
engine's timers are read and cleared here, once per interval, whenever the engine times its actions
(`TrainConfig.times_actions`); with --log-timers-to-tensorboard alone they go to TensorBoard only.
"""
from __future__ import annotations

import math
import time

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
    def __init__(self, cfg, grid, device, engine, logger: TrainLogger, start: int = 0):
        self.cfg, self.grid, self.device, self.engine, self.logger = \
            cfg, grid, device, engine, logger
        self.pace = Pace(cfg.train.train_iters)
        self.flops = flops_per_sample(cfg)
        self.first = True   # the run's first interval holds the warm-up
        self.started, self.start = time.time(), start
        self.skipped_before = engine.skipped_iterations
        self.plan = cfg.replace(parallel={"data": grid.data}).batch_plan  # samples by iteration
        self.last_train = self.last_valid = self.best_valid = None

    def interval(self, iteration: int, losses: list[float],
                 skipped_after: list[int] | None = None) -> None:
        """Log the interval that ends after `iteration` (`losses`: one per iteration of it;
        `skipped_after`: the engine's skipped-step count after each, to leave skipped fp16
        steps out of the mean)."""
        cfg, t, engine, grid = self.cfg, self.cfg.train, self.engine, self.grid
        n = len(losses)
        skipped_after = skipped_after or [engine.skipped_iterations] * n
        counts = [self.skipped_before] + list(skipped_after)
        kept = [x for x, a, b in zip(losses, counts, counts[1:]) if b == a]
        self.skipped_before = counts[-1]
        mean = sum(kept) / len(kept) if kept else float("nan")
        self.last_train = mean if kept else self.last_train
        seconds, eta = self.pace.interval(iteration, n)
        consumed = self.plan.consumed  # a batch-size ramp's real sum
        rate = (consumed(iteration) - consumed(iteration - n)) / max(seconds, 1e-9)
        metrics = {"consumed samples": consumed(iteration),
                   "ms/iteration": 1e3 * seconds / max(n, 1), "ETA": format_duration(eta),
                   "lr": engine.stepper.last_lr,
                   **({"decoupled lr": engine.stepper.last_decoupled_lr}
                      if engine.stepper.last_decoupled_lr is not None else {}),
                   "lm loss": mean,
                   "grad norm": float(engine.last_grad_norm),
                   **({"params norm": engine.params_norm()} if t.log_params_norm else {}),
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
        rows = self.megatron_rows(iteration, losses, counts, metrics, seconds / max(n, 1))
        self.logger.log(iteration, metrics,
                        timers if t.log_timers_to_tensorboard and not t.wall_clock_breakdown
                        else None, rows=rows)
        if straggler is not None:
            self.logger.note(straggler)
        self.first = False

    def megatron_rows(self, iteration: int, losses: list[float], counts: list[int],
                      metrics: dict, seconds_per_iteration: float) -> list:
        """[(iteration, samples, {Megatron tag: value})] of this interval for the writers."""
        t, plan = self.cfg.train, self.plan
        lr_at = self.engine.lr_schedule
        rows = []
        first = iteration - len(losses) + 1
        for i, (loss, a, b) in enumerate(zip(losses, counts, counts[1:])):
            it = first + i
            if it % t.tensorboard_log_interval == 0 or it == iteration:
                tags = {"learning-rate": float(lr_at(it - 1)),
                        "batch-size": float(plan.batch(it - 1))}
                if self.cfg.optimizer.decoupled_lr is not None:  # Megatron's tag for it
                    tags["decoupled-learning-rate"] = float(lr_at.decoupled(it - 1))
                if a == b:  # a skipped fp16 step's loss is not reported
                    tags["lm loss"] = float(loss)
                rows.append((it, plan.consumed(it), tags))
        end = {"grad-norm": metrics["grad norm"], "loss-scale": metrics["loss scale"],
               "iteration-time": seconds_per_iteration, "throughput": metrics["TFLOP/s/device"]}
        if "params norm" in metrics:
            end["params-norm"] = metrics["params norm"]
        rows.append((iteration, plan.consumed(iteration), end))
        return rows

    def validation(self, iteration: int, loss: float) -> None:
        ppl = math.exp(min(loss, PPL_CAP))
        self.last_valid = loss
        self.best_valid = loss if self.best_valid is None else min(self.best_valid, loss)
        self.logger.log(iteration, {"validation loss": loss, "validation ppl": ppl},
                        rows=[(iteration, self.plan.consumed(iteration),
                               {"lm loss validation": loss, "lm loss validation ppl": ppl})])

    def summary(self, iteration: int, checkpoint: str | None) -> None:
        """The run's last line: iterations, samples, tokens, wall time, mean throughput, final
        train and validation loss, best validation loss, last checkpoint."""
        iters = iteration - self.start
        samples = self.plan.consumed(iteration) - self.plan.consumed(self.start)
        seconds = time.time() - self.started
        show = (lambda x: "n/a" if x is None else f"{x:.4g}")  # noqa: E731
        self.logger.note(
            f"run summary | iterations {iters} ({self.start}->{iteration}) | samples {samples} | "
            f"tokens {samples * self.cfg.model.seq_length} | wall time "
            f"{format_duration(seconds)} | samples/s {samples / max(seconds, 1e-9):.4g} | "
            f"final lm loss {show(self.last_train)} | final validation loss "
            f"{show(self.last_valid)} | best validation loss {show(self.best_valid)} | "
            f"last checkpoint {checkpoint or 'none'}")
