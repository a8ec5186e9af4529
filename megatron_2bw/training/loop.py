"""The training loop shared by the pretrain scripts: train to --train-iters, resuming, evaluating,
saving and logging as configured (the engine and its data come from build.py)."""
from __future__ import annotations

import time
from typing import Callable, Iterator

import torch

from megatron_2bw.checkpoint.api import check_iterations, load_checkpoint
from megatron_2bw.config import Config
from megatron_2bw.data.prefetch import close_pipelines, input_pipeline
from megatron_2bw.parallel.grid import ProcessGrid
from megatron_2bw.pipeline.faults import NO_FAULTS, FaultHooks, NumericsError
from megatron_2bw.training.build import build_engine
from megatron_2bw.training.kernels import kernels_line
from megatron_2bw.training.observe.interval_log import IntervalLog
from megatron_2bw.training.observe.logger import TrainLogger
from megatron_2bw.training.observe.profiling import StepProfiler
from megatron_2bw.training.reliability import Preemption, check_numerics, process_start_time


def _stop_requested(cfg: Config, started: float, iteration: int, engine) -> bool:
    """--exit-interval (the same iteration everywhere) / --exit-duration-in-mins (counted from
    `started`: the process start, as Megatron counts): each rank raises its own clock's verdict
    into the next batch's reductions and every rank reads the same agreed one
    (pipeline/flags.py), so all stop at the same boundary with no collective."""
    if cfg.train.exit_interval and iteration % cfg.train.exit_interval == 0:
        return True
    if cfg.train.exit_duration_in_mins:
        flags = engine.stepper.flags
        flags.raise_flag("exit_duration",
                         time.time() - started > 60 * cfg.train.exit_duration_in_mins)
        return flags.agreed()["exit_duration"]
    return False


def samples_consumed_by(cfg: Config, grid: ProcessGrid) -> Callable[[int], int]:
    """iteration -> the samples the first `iteration` iterations consume: the one place the loop
    learns the global batch (iteration i trains consumed(i) - consumed(i - 1) samples; a
    batch-size ramp changes that between iterations: the config's batch plan). The logs take it
    from the loop."""
    return cfg.replace(parallel={"data": grid.data}).batch_plan.consumed


def train(cfg: Config, grid: ProcessGrid, device, make_data: Callable[[int], Iterator],
          make_eval_data: Callable[[], Iterator] | None = None, log=print,
          hooks: FaultHooks = NO_FAULTS, lr_schedule=None, progress=None,
          started: float | None = None, beside: dict[str, bytes] | None = None) -> list[float]:
    """Train to cfg.train.train_iters (resuming from --load), evaluating, saving and logging as
    configured (--skip-train: evaluate --eval-iters batches on the loaded weights, nothing
    more). make_data(start_batch) gives this replica's training microbatches; lr_schedule
    (iteration -> lr, e.g. a DeepSpeed JSON's) replaces the Config's. Returns the losses of the
    iterations run (read on the host only at log intervals). `progress`: a terminal stream for
    the progress bar (None: plain lines). `hooks` injects faults (tests only: pipeline/faults.py
    FaultHooks). `started`: when --exit-duration-in-mins starts counting (time.time(); None: when
    this process started, so start-up and checkpoint loading count). `beside`: the files every
    save publishes beside its iterations in --save (name -> bytes: the tokenizer,
    checkpoint/convert/tokenizers.tokenizer_files)."""
    t = cfg.train
    started = process_start_time() if started is None else started
    # SIGTERM/SIGUSR1/SIGINT from here on end in a checkpoint, also while loading
    preemption = Preemption() if t.save and not t.skip_train else None
    reporter = grid.is_last_stage and grid.dp_rank == 0 and grid.tp_rank == 0
    engine = build_engine(cfg, grid, device, lr_schedule=lr_schedule)
    engine.loss_fn = hooks.wrap_loss(engine.loss_fn, engine)
    hooks.on_engine(engine)
    if reporter:
        log(kernels_line(cfg, grid.tensor, device, engine.stepper.optimizer.impl))
    start = load_checkpoint(t.load, engine, cfg, grid, t.load_optim, t.finetune,
                            log=log if reporter else None, load_rng=t.load_rng) if t.load else 0
    if not t.skip_train:
        check_iterations(t.train_iters, start, t.load)
    if start and reporter:
        log(f"loading checkpoint from {t.load} at iteration {start}")
    if start == t.train_iters and reporter and not t.skip_train:
        log(f"the checkpoint in {t.load} is at iteration {start} = --train-iters: nothing to "
            "train (raise --train-iters to continue)")
    data = None if t.skip_train else input_pipeline(make_data(start), "train data", grid,
                                                     device, t.num_workers)
    evaluates = t.skip_train or (
        t.eval_interval and t.train_iters // t.eval_interval > start // t.eval_interval)
    eval_data = input_pipeline(make_eval_data(), "validation data", grid, device,
                               t.num_workers) if (make_eval_data and evaluates) else None
    logger = TrainLogger(cfg, grid, reporter, log, progress, start)
    consumed = samples_consumed_by(cfg, grid)
    report = IntervalLog(cfg, grid, device, engine, logger, start, consumed(start))
    if t.skip_train:  # Megatron's --skip-train: evaluate the weights loaded, train none
        total = sum(float(engine.eval_batch(eval_data)) for _ in range(t.eval_iters))
        report.validation(start, total / t.eval_iters, on_validation_set=True)
        close_pipelines(eval_data)
        report.summary(engine.iteration, None)
        logger.finish()
        return []
    profiler = StepProfiler(t, grid, engine, start)
    if start < t.train_iters:
        engine.start(t.train_iters - start)
    if t.trace:
        engine.enable_trace()
    saver = None
    if t.save:
        from megatron_2bw.checkpoint.api import remove_leftovers
        from megatron_2bw.checkpoint.saver import Checkpointer
        if grid.rank == 0:  # every rank passed its checks and started; none writes yet
            remove_leftovers(t.save, log)
        saver = Checkpointer(cfg, grid, engine, hooks, log if reporter else None, beside)
    pending, skips, sizes, losses, saved_at = [], [], [], [], None
    last_good = f"iteration {start} in {t.load}" if start else None

    def check_nan(newest: bool = False) -> None:
        """--check-for-nan-in-loss-and-grad: the loss and per-stage gradient finiteness of the
        batch before the newest, read without waiting (pipeline/flags.py), or of the newest
        (before a checkpoint or the end: never save a diverged step)."""
        if t.check_for_nan_in_loss_and_grad:
            try:
                check_numerics(engine.stepper.flags.numerics(newest), grid, cfg.precision.dtype,
                               last_good)
            except NumericsError:
                if saver is not None:  # every rank stops here: publish the save in flight
                    saver.wait()
                raise

    profiler.step(start)
    for it in range(start + 1, t.train_iters + 1):
        pending.append(engine.train_batch(data).detach().clone())
        skips.append(engine.skipped_iterations)  # a host count: the interval mean leaves them out
        sizes.append(consumed(it) - consumed(it - 1))
        hooks.after_iteration(grid, it)
        if saver is not None:
            saver.poll()  # publishes an --async-save once every rank has written it
        profiler.step(it)
        logger.step(it)
        check_nan()
        logs = it % t.log_interval == 0 or it == t.train_iters
        evaluating = eval_data is not None and it % t.eval_interval == 0
        if logs or evaluating:  # the loss read: once per log interval, and before an evaluation
            values = torch.stack(pending).tolist()  # (which reads the device anyway), so its
            losses += values                        # point follows its iteration's (wandb)
            pending.clear()
            report.record(values, skips, sizes, interval_end=logs)
            skips, sizes = [], []
        if logs:
            report.interval(it)
        if evaluating:
            total = sum(float(engine.eval_batch(eval_data)) for _ in range(t.eval_iters))
            report.validation(it, total / t.eval_iters)
        stop = _stop_requested(cfg, started, it, engine)
        preempted = preemption is not None and preemption.agreed(engine)
        saving = t.save and ((t.save_interval and it % t.save_interval == 0) or stop
                             or preempted or it == t.train_iters)
        if saving or stop or it == t.train_iters:
            check_nan(newest=True)
        if saving:
            saver.save(wait=preempted or stop)  # a preemption waits for the save in flight
            saved_at, last_good = it, f"iteration {it} in {t.save}"
        if preempted:
            if reporter:
                log(f"{preemption.signal_name or 'a preemption signal to another rank'}: saved "
                    f"a checkpoint at iteration {it} in {t.save}"
                    "; exiting (resume with --load)")
            stop = True
        if stop:
            break
    profiler.close()
    if preemption is not None:
        preemption.restore()
    if pending:  # stopped between log intervals: the writers still get these iterations
        values = torch.stack(pending).tolist()
        losses += values
        report.record(values, skips, sizes)
    close_pipelines(data, eval_data)
    if t.trace:
        engine.save_trace(f"{t.trace}.rank{grid.rank}.json")
    if t.save and saved_at is None and engine.iteration > start:
        saver.save()
    if saver is not None:
        saver.wait()
    report.summary(engine.iteration, f"iteration {saved_at or engine.iteration} in {t.save}"
                   if t.save and engine.iteration > start else None)
    logger.finish()
    return losses
