"""Building a run from the config: this rank's engine, its data role and its microbatches (the
process grid: parallel/grid.py `ProcessGrid.from_config`)."""
from __future__ import annotations

from megatron_2bw.config import Config
from megatron_2bw.models.families import FAMILIES, model_parts
from megatron_2bw.parallel.grid import ProcessGrid
from megatron_2bw.pipeline.engine import PipelineEngine
from megatron_2bw.tensor_parallel import TPGroup


def data_role(cfg: Config, rank: int, world_size: int,
              node: list[int] | None) -> tuple[bool, bool]:
    """(reads, builder) of a rank, before any process group: whether it reads batches (the
    first and the last pipeline stage; the middle ones receive activations) and whether it
    builds its node's data caches: the first rank of `node` (the ranks sharing this node,
    parallel/launcher.py `node_ranks`) that reads data. With `node` unknown every rank that
    reads builds: several builders are harmless (data/cache.py publishes create-if-absent),
    a node without one would wait for the cache until its timeout."""
    grid = ProcessGrid.from_config(cfg, rank, world_size)
    d = grid.pipeline

    def reads(r: int) -> bool:
        return grid.coords(r)[1] in (0, d - 1)
    if node is None:
        return reads(rank), reads(rank)
    return reads(rank), reads(rank) and not any(reads(r) for r in node if r < rank)


def build_engine(cfg: Config, grid: ProcessGrid, device, engine_class=PipelineEngine,
                 lr_schedule=None):
    """The configured model's stage on this rank, run by `engine_class` (a PipelineEngine);
    `lr_schedule` (iteration -> lr) replaces the Config's Megatron schedule when given."""
    specs, loss_fn, partition = model_parts(cfg, TPGroup.from_grid(grid), grid.pipeline)
    return engine_class(cfg, grid, specs, loss_fn, partition, device, lr_schedule=lr_schedule,
                        dynamic_shape="fixed")  # every batch [b, seq]: no shape headers


def batches(cfg: Config, dataset, data_parallel_size: int, dp_rank: int, start_batch: int = 0,
            training: bool = True):
    """Microbatches of `dataset` for one data-parallel replica, from batch `start_batch` on:
    training batches follow the config's batch plan (a batch-size ramp), evaluation batches
    (`training=False`) are all of the final global batch."""
    batches_cls = FAMILIES[cfg.model.family].batches
    on_grid = cfg.replace(parallel={"data": data_parallel_size})
    m = on_grid.batch_plan if training else on_grid.num_microbatches
    eod = {"eod": cfg.model.eod_token} if cfg.model.eod_mask_loss else {}  # GPT only (config)
    return batches_cls(dataset, cfg.batch.micro_batch_size, m, data_parallel_size, dp_rank,
                       start_batch=start_batch, **eod)


def mock_dataset(cfg: Config):
    return FAMILIES[cfg.model.family].mock_dataset(cfg.model.vocab_size, cfg.model.seq_length,
                                                   seed=cfg.train.seed)


def mock_batches(cfg: Config, data_parallel_size: int, dp_rank: int, start_batch: int = 0,
                 training: bool = True):
    """Synthetic microbatches of the configured family for one data-parallel replica."""
    return batches(cfg, mock_dataset(cfg), data_parallel_size, dp_rank, start_batch, training)
