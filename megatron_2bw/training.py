"""Building an engine from the config, and the training loop shared by the pretrain scripts."""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterator

import torch

from .checkpointing import check_iterations, load_checkpoint, save_checkpoint
from .config import Config
from .data.bert_mock import BertBatches, MockBertDataset
from .data.mock import GPTBatches, MockGPTDataset
from .data.prefetch import close_pipelines, input_pipeline
from .interval_log import IntervalLog
from .logger import TrainLogger
from .models.bert import bert_layer_specs, bert_partition, make_bert_loss
from .models.gpt import gpt_layer_specs, gpt_partition, make_gpt_loss
from .parallel.grid import ProcessGrid
from .pipeline.engine import PipelineEngine
from .profiling import StepProfiler
from .reliability import NO_FAULTS, FaultHooks, Preemption, check_numerics
from .tensor_parallel import TPGroup

FAMILIES = {
    "gpt": (gpt_layer_specs, make_gpt_loss, gpt_partition, MockGPTDataset, GPTBatches),
    "bert": (bert_layer_specs, make_bert_loss, bert_partition, MockBertDataset, BertBatches),
}


def build_grid(cfg: Config, rank: int, world_size: int, comm=None) -> ProcessGrid:
    """The process groups of `cfg`'s layout on `world_size` ranks (the training loop's and the
    DeepSpeed adapter's), created through `comm` (default: a Comm of the process group)."""
    grid = ProcessGrid(cfg.parallel.tensor, cfg.parallel.pipeline,
                       cfg.resolved(world_size).data_parallel_size, rank=rank,
                       rank_order=cfg.parallel.rank_order)
    return grid.init_groups(comm)


def model_parts(cfg: Config, tp: TPGroup = TPGroup(), num_stages: int = 1):
    """(layer specs, loss function, stage boundaries) of the configured model family."""
    specs_fn, loss_fn, partition_fn, _, _ = FAMILIES[cfg.model.family]
    if cfg.parallel.sequence_parallel != tp.sequence_parallel:
        tp = dataclasses.replace(tp, sequence_parallel=cfg.parallel.sequence_parallel)
    partition = cfg.parallel.partition if (cfg.parallel.partition and num_stages > 1) else \
        partition_fn(cfg.model, num_stages)
    return specs_fn(cfg.model, tp, seed=cfg.train.seed), loss_fn(tp), partition


def build_engine(cfg: Config, grid: ProcessGrid, device, engine_class=PipelineEngine,
                 lr_schedule=None):
    """The configured model's stage on this rank, run by `engine_class` (a PipelineEngine);
    `lr_schedule` (iteration -> lr) replaces the Config's Megatron schedule when given."""
    specs, loss_fn, partition = model_parts(cfg, TPGroup.from_grid(grid), grid.pipeline)
    return engine_class(cfg, grid, specs, loss_fn, partition, device, lr_schedule=lr_schedule)


def batches(cfg: Config, dataset, data_parallel_size: int, dp_rank: int, start_batch: int = 0):
    """Microbatches of `dataset` for one data-parallel replica, from batch `start_batch` on."""
    batches_cls = FAMILIES[cfg.model.family][4]
    m = cfg.replace(parallel={"data": data_parallel_size}).num_microbatches
    return batches_cls(dataset, cfg.batch.micro_batch_size, m, data_parallel_size, dp_rank,
                       start_batch=start_batch)


def mock_dataset(cfg: Config):
    return FAMILIES[cfg.model.family][3](cfg.model.vocab_size, cfg.model.seq_length,
                                         seed=cfg.train.seed)


def mock_batches(cfg: Config, data_parallel_size: int, dp_rank: int, start_batch: int = 0):
    """Synthetic microbatches of the configured family for one data-parallel replica."""
    return batches(cfg, mock_dataset(cfg), data_parallel_size, dp_rank, start_batch)


def _stop_requested(cfg: Config, started: float, iteration: int, engine) -> bool:
    """--exit-interval (the same iteration everywhere) / --exit-duration-in-mins: each rank
    raises its own clock's verdict into the next batch's reductions and every rank reads the
    same agreed one (pipeline/flags.py), so all stop at the same boundary with no collective."""
    if cfg.train.exit_interval and iteration % cfg.train.exit_interval == 0:
        return True
    if cfg.train.exit_duration_in_mins:
        flags = engine.stepper.flags
        flags.raise_flag("exit_duration",
                         time.time() - started > 60 * cfg.train.exit_duration_in_mins)
        return flags.agreed()["exit_duration"]
    return False


def train(cfg: Config, grid: ProcessGrid, device, make_data: Callable[[int], Iterator],
          make_eval_data: Callable[[], Iterator] | None = None, log=print,
          hooks: FaultHooks = NO_FAULTS, lr_schedule=None, progress=None) -> list[float]:
    """Train to cfg.train.train_iters (resuming from --load), evaluating, saving and logging as
    configured. make_data(start_batch) gives this replica's training microbatches; lr_schedule
    (iteration -> lr, e.g. a DeepSpeed JSON's) replaces the Config's. Returns the losses of the
    iterations run (read on the host only at log intervals). `progress`: a terminal stream for
    the progress bar (None: plain lines). `hooks` injects faults (tests only:
    reliability.FaultHooks)."""
    t = cfg.train
    reporter = grid.is_last_stage and grid.dp_rank == 0 and grid.tp_rank == 0
    engine = build_engine(cfg, grid, device, lr_schedule=lr_schedule)
    engine.loss_fn = hooks.wrap_loss(engine.loss_fn, engine)
    hooks.on_engine(engine)
    start = load_checkpoint(t.load, engine, cfg, grid, t.load_optim, t.finetune,
                            log=log if reporter else None) if t.load else 0
    check_iterations(t.train_iters, start, t.load)
    if start == t.train_iters and reporter:
        log(f"the checkpoint in {t.load} is at iteration {start} = --train-iters: nothing to "
            "train (raise --train-iters to continue)")
    data = input_pipeline(make_data(start), "train data", grid, device)
    eval_data = input_pipeline(make_eval_data(), "validation data", grid, device) \
        if (make_eval_data and t.eval_interval) else None
    logger = TrainLogger(cfg, grid, reporter, log, progress, start)
    report = IntervalLog(cfg, grid, device, engine, logger)
    profiler = StepProfiler(t, grid, engine, start)
    if start < t.train_iters:
        engine.start(t.train_iters - start)
    if t.trace:
        engine.enable_trace()
    preemption = Preemption() if t.save else None
    save = lambda: save_checkpoint(t.save, engine, cfg, grid, t.save_optim,  # noqa: E731
                                   t.keep_last, hooks)
    pending, losses, saved_at = [], [], None
    last_good = f"iteration {start} in {t.load}" if start else None

    def check_nan(newest: bool = False) -> None:
        """--check-for-nan-in-loss-and-grad: the loss and per-stage gradient finiteness of the
        batch before the newest, read without waiting (pipeline/flags.py), or of the newest
        (before a checkpoint or the end: never save a diverged step)."""
        if t.check_for_nan_in_loss_and_grad:
            check_numerics(engine.stepper.flags.numerics(newest), grid, cfg.precision.dtype,
                           last_good)

    started = time.time()
    profiler.step(start)
    for it in range(start + 1, t.train_iters + 1):
        pending.append(engine.train_batch(data).detach().clone())
        hooks.after_iteration(grid, it)
        profiler.step(it)
        logger.step(it)
        check_nan()
        if it % t.log_interval == 0 or it == t.train_iters:
            values = torch.stack(pending).tolist()  # the only loss read: once per log interval
            losses += values
            pending.clear()
            report.interval(it, values)
        if eval_data is not None and it % t.eval_interval == 0:
            total = sum(float(engine.eval_batch(eval_data)) for _ in range(t.eval_iters))
            report.validation(it, total / t.eval_iters)
        stop = _stop_requested(cfg, started, it, engine)
        preempted = preemption is not None and preemption.agreed(engine)
        saving = t.save and ((t.save_interval and it % t.save_interval == 0) or stop
                             or preempted or it == t.train_iters)
        if saving or stop or it == t.train_iters:
            check_nan(newest=True)
        if saving:
            save()
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
    if pending:
        losses += torch.stack(pending).tolist()
    close_pipelines(data, eval_data)
    if t.trace:
        engine.save_trace(f"{t.trace}.rank{grid.rank}.json")
    if t.save and saved_at is None and engine.iteration > start:
        save()
    logger.finish()
    return losses
