"""What the training loop logs at each log interval and evaluation (the fields, in line order;
the line itself is Megatron's, training/observe/log_line.py):

    consumed samples, elapsed time per iteration   the loop's batch sizes; training/observe/
    (ms) [, throughput per GPU (TFLOP/s/GPU)]      progress.py (host wall clock, no sync);
                                                   --log-throughput, Megatron's model FLOPs
                                                   (models/flops.py)
    learning rate [, decoupled learning rate],     the engine (read once per interval; the
    global batch size, lm loss, loss scale, grad   decoupled lr: --decoupled-lr; params norm:
    norm [, params norm], number of skipped        --log-params-norm, a collective); lm loss is
    iterations, number of nan iterations           the mean over the interval's iterations,
                                                   skipped fp16 steps left out; the skipped and
                                                   nan counts are the interval's (Megatron's)
    ETA, samples/s, tokens/s                       ours, after Megatron's fields
    memory GB per stage [, reserved GB per stage]  training/observe/memory.py (peaks of the
                                                   interval)
    2bw compensation                               --2bw-compensation, when one is on
    ms <action> ...                                --wall-clock-breakdown (pipeline/timers.py)
    compute/wait ms per stage, slowest rank ...    --log-straggler (training/observe/straggler.py)

and at each --eval-interval Megatron's validation line (lm loss value, lm loss PPL =
exp(min(loss, 20))).

TensorBoard and wandb get Megatron's tags besides (`megatron_rows`): per iteration (every
--tensorboard-log-interval, and the interval's last) `lm loss`, `learning-rate`, `batch-size`;
per interval `grad-norm`, `loss-scale`, `iteration-time` (seconds), `throughput` (TFLOP/s/device,
always), `skipped-iterations`, `nan-iterations`; per evaluation `lm loss validation` and `lm loss
validation ppl`; TensorBoard also each as `<tag> vs samples`, wandb `samples vs steps` (training/
observe/writers.py). `summary` is the run's last line.

The loop hands over each iteration (`record`: its loss, the engine's skipped count after it, its
global batch) before it logs an interval (`interval`) or evaluates at or after it
(`validation`), so every write lands at a step no earlier than the last one written (wandb's
step is the iteration and it drops a point logged to an earlier step). `interval` is collective
(memory and straggler tables are gathered from every rank) and is called on every rank; only
the reporting rank prints and writes (training/observe/logger.py). The engine's timers are read
and cleared here, once per interval, whenever the engine times its actions
(`TrainConfig.times_actions`); with --log-timers-to-tensorboard alone they go to TensorBoard only.
"""
from __future__ import annotations

import math
import time

from megatron_2bw.config.choices import NO_COMPENSATION
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
    """`consumed`: the samples consumed before iteration `start + 1` (the loop's count)."""

    def __init__(self, cfg, grid, device, engine, logger: TrainLogger, start: int = 0,
                 consumed: int = 0):
        self.cfg, self.grid, self.device, self.engine, self.logger = \
            cfg, grid, device, engine, logger
        self.pace = Pace(cfg.train.train_iters)
        self.flops = flops_per_sample(cfg)
        self.first = True   # the run's first interval holds the warm-up
        self.started, self.start = time.time(), start
        self.iteration, self.consumed, self.consumed_start = start, consumed, consumed
        self.skipped_before = engine.skipped_iterations
        self.last_train = self.last_valid = self.best_valid = None
        self.batch = cfg.global_batch_size
        self._open_interval()

    def _open_interval(self) -> None:
        self.kept, self.iterations, self.skipped, self.nan = [], 0, 0, 0
        self.interval_samples = 0

    def record(self, losses: list[float], skipped_after: list[int], batch_sizes: list[int],
               interval_end: bool = False) -> None:
        """The iterations after the last recorded one: their losses, the engine's skipped-step
        count after each (a skipped fp16 step's loss is left out of the mean and not written),
        their global batches. Their per-iteration rows go to the writers now (`interval_end`:
        the last of them ends a log interval, and gets its row whatever
        --tensorboard-log-interval says)."""
        tb_every, lr_at = self.cfg.train.tensorboard_log_interval, self.engine.lr_schedule
        counts = [self.skipped_before] + list(skipped_after)
        rows = []
        for i, (loss, a, b, batch) in enumerate(zip(losses, counts, counts[1:], batch_sizes)):
            self.iteration += 1
            self.consumed += batch
            self.interval_samples += batch
            self.iterations += 1
            self.batch = batch
            it, skipped = self.iteration, b != a
            if skipped:
                self.skipped += 1
                self.nan += not math.isfinite(loss)
            else:
                self.kept.append(loss)
            if it % tb_every == 0 or (interval_end and i == len(losses) - 1):
                tags = {"learning-rate": float(lr_at(it - 1)), "batch-size": float(batch)}
                if self.cfg.optimizer.decoupled_lr is not None:  # Megatron's tag for it
                    tags["decoupled-learning-rate"] = float(lr_at.decoupled(it - 1))
                if not skipped:
                    tags["lm loss"] = float(loss)
                rows.append((it, self.consumed, tags))
        self.skipped_before = counts[-1]
        self.logger.rows(rows)

    def interval(self, iteration: int) -> None:
        """Log the interval that ends after `iteration` (its iterations `record`ed before)."""
        cfg, t, engine, grid = self.cfg, self.cfg.train, self.engine, self.grid
        n = max(self.iterations, 1)
        mean = sum(self.kept) / len(self.kept) if self.kept else None
        self.last_train = mean if mean is not None else self.last_train
        seconds, eta = self.pace.interval(iteration, self.iterations)
        rate = self.interval_samples / max(seconds, 1e-9)
        tflops = rate * self.flops / grid.world_size / 1e12
        stepper = engine.stepper
        fields = {"consumed samples": self.consumed,
                  "elapsed time per iteration (ms)": 1e3 * seconds / n,
                  **({"throughput per GPU (TFLOP/s/GPU)": tflops} if t.log_throughput else {}),
                  "learning rate": stepper.last_lr,
                  **({"decoupled learning rate": stepper.last_decoupled_lr}
                     if stepper.last_decoupled_lr is not None else {}),
                  "global batch size": self.batch,
                  **({"lm loss": mean} if mean is not None else {}),
                  "loss scale": stepper.scaler.scale,
                  "grad norm": float(engine.last_grad_norm),
                  **({"params norm": engine.params_norm()} if t.log_params_norm else {}),
                  "number of skipped iterations": self.skipped,
                  "number of nan iterations": self.nan,
                  # ours, after Megatron's
                  "ETA": format_duration(eta), "samples/s": rate,
                  "tokens/s": rate * cfg.model.seq_length,
                  **memory_per_stage(grid, self.device),
                  **({"2bw compensation": cfg.compensation}
                     if cfg.compensation != NO_COMPENSATION else {})}
        timers, straggler = {}, None
        if t.times_actions:
            totals = dict(engine.timers)
            engine.timers.clear()
            timers = {f"ms {k}": 1e3 * v / n for k, v in totals.items()}
            if t.log_straggler:
                rows = grid.comm.gather_floats(rank_times(totals, n))
                report, straggler = straggler_report(rows, grid, t.straggler_threshold,
                                                     iteration, name=not self.first)
                fields.update(report)
        if t.wall_clock_breakdown:
            fields.update(timers)
        self.logger.log(iteration, fields,
                        timers if t.log_timers_to_tensorboard and not t.wall_clock_breakdown
                        else None, rows=self.megatron_rows(iteration, fields, seconds / n,
                                                           tflops))
        if straggler is not None:
            self.logger.note(straggler)
        self.first = False
        self._open_interval()

    def megatron_rows(self, iteration: int, fields: dict, seconds_per_iteration: float,
                      tflops: float) -> list:
        """[(iteration, samples, {Megatron tag: value})] of the interval's end."""
        end = {"grad-norm": fields["grad norm"], "loss-scale": fields["loss scale"],
               "iteration-time": seconds_per_iteration, "throughput": tflops,
               "skipped-iterations": float(self.skipped), "nan-iterations": float(self.nan)}
        if "params norm" in fields:
            end["params-norm"] = fields["params norm"]
        return [(iteration, self.consumed, end)]

    def validation(self, iteration: int, loss: float, on_validation_set: bool = False) -> None:
        """Megatron's validation line after `iteration` (recorded before); `on_validation_set`:
        --skip-train's evaluation (Megatron's prefix for the one after training)."""
        ppl = math.exp(min(loss, PPL_CAP))
        self.last_valid = loss
        self.best_valid = loss if self.best_valid is None else min(self.best_valid, loss)
        self.logger.validation(iteration, loss, ppl, rows=[(
            iteration, self.consumed, {"lm loss validation": loss,
                                       "lm loss validation ppl": ppl})],
            on_validation_set=on_validation_set)

    def summary(self, iteration: int, checkpoint: str | None) -> None:
        """The run's last line: iterations, samples, tokens, wall time, mean throughput, final
        train and validation loss, best validation loss, last checkpoint."""
        iters = iteration - self.start
        samples = self.consumed - self.consumed_start
        seconds = time.time() - self.started
        show = (lambda x: "n/a" if x is None else f"{x:.4g}")  # noqa: E731
        self.logger.note(
            f"run summary | iterations {iters} ({self.start}->{iteration}) | samples {samples} | "
            f"tokens {samples * self.cfg.model.seq_length} | wall time "
            f"{format_duration(seconds)} | samples/s {samples / max(seconds, 1e-9):.4g} | "
            f"final lm loss {show(self.last_train)} | final validation loss "
            f"{show(self.last_valid)} | best validation loss {show(self.best_valid)} | "
            f"last checkpoint {checkpoint or 'none'}")
