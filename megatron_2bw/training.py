"""Building a GPT pipeline engine from the config, and the training loop shared by the scripts."""
from __future__ import annotations

import time

import torch

from .config import Config
from .data.bert_mock import BertBatches, MockBertDataset
from .data.mock import GPTBatches, MockGPTDataset
from .models.bert import bert_layer_specs, bert_partition, make_bert_loss
from .models.gpt import gpt_layer_specs, gpt_partition, make_gpt_loss
from .parallel.grid import ProcessGrid
from .pipeline.engine import PipelineEngine
from .tensor_parallel import TPGroup

def build_grid(cfg: Config, rank: int, world_size: int) -> ProcessGrid:
    grid = ProcessGrid(cfg.parallel.tensor, cfg.parallel.pipeline,
                       cfg.data_parallel_size(world_size), rank=rank,
                       rank_order=cfg.parallel.rank_order)
    return grid.init_groups()

FAMILIES = {
    "gpt": (gpt_layer_specs, make_gpt_loss, gpt_partition, MockGPTDataset, GPTBatches),
    "bert": (bert_layer_specs, make_bert_loss, bert_partition, MockBertDataset, BertBatches),
}

def model_parts(cfg: Config, tp: TPGroup = TPGroup(), num_stages: int = 1):
    """(layer specs, loss function, stage boundaries) of the configured model family."""
    specs_fn, loss_fn, partition_fn, _, _ = FAMILIES[cfg.model.family]
    return (specs_fn(cfg.model, tp, seed=cfg.train.seed), loss_fn(tp),
            partition_fn(cfg.model, num_stages))

def build_engine(cfg: Config, grid: ProcessGrid, device, fault: str | None = None):
    specs, loss_fn, partition = model_parts(cfg, TPGroup.from_grid(grid), grid.pipeline)
    return PipelineEngine(cfg, grid, specs, loss_fn, partition, device, fault=fault)

def mock_batches(cfg: Config, data_parallel_size: int, dp_rank: int, start_batch: int = 0):
    """Synthetic microbatches of the configured family for one data-parallel replica."""
    _, _, _, dataset_cls, batches_cls = FAMILIES[cfg.model.family]
    dataset = dataset_cls(cfg.model.vocab_size, cfg.model.seq_length, seed=cfg.train.seed)
    m = cfg.batch.global_batch_size // (cfg.batch.micro_batch_size * data_parallel_size)
    return batches_cls(dataset, cfg.batch.micro_batch_size, m, data_parallel_size, dp_rank,
                       start_batch=start_batch)

def train(cfg: Config, grid: ProcessGrid, device, log=print) -> list[float]:
    """Train cfg.train.train_iters batches on mock data; log from the last stage's first replica.
    Returns the per-iteration losses (read on the host only at log intervals)."""
    engine = build_engine(cfg, grid, device)
    data = mock_batches(cfg, grid.data, grid.dp_rank)
    engine.start(cfg.train.train_iters)
    samples_per_iter = cfg.batch.global_batch_size
    pending, losses = [], []
    t0, done_since = time.perf_counter(), 0
    reporter = grid.is_last_stage and grid.dp_rank == 0 and grid.tp_rank == 0
    for it in range(cfg.train.train_iters):
        loss = engine.train_batch(data)
        pending.append(loss.detach().clone())
        done_since += 1
        if (it + 1) % cfg.train.log_interval == 0 or it + 1 == cfg.train.train_iters:
            values = torch.stack(pending).tolist()  # the only host read: once per log interval
            losses += values
            pending.clear()
            elapsed = time.perf_counter() - t0
            if reporter:
                log(f"iteration {it + 1:6d}/{cfg.train.train_iters} | "
                    f"consumed samples {samples_per_iter * (it + 1):8d} | "
                    f"lr {engine.stepper.last_lr:.3e} | loss {values[-1]:.4f} | "
                    f"grad norm {float(engine.last_grad_norm):.3f} | "
                    f"skipped {engine.skipped_iterations} | "
                    f"samples/s {samples_per_iter * done_since / elapsed:.1f}")
            t0, done_since = time.perf_counter(), 0
    return losses
