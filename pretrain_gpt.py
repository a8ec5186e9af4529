#!/usr/bin/env python
"""Pretrain a GPT with the 2BW (or flush / gpipe) pipeline engine. Megatron-LM flag names.

  torchrun --standalone --nproc_per_node 2 pretrain_gpt.py --mock-data \
      --pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 64 --num-attention-heads 4 \
      --seq-length 32 --micro-batch-size 4 --global-batch-size 32 --train-iters 60 --lr 3e-3

Every bad flag or setting is reported in one line before any process group starts.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_2bw.arguments import (FlagParser, add_model_args, add_parallel_args,  # noqa: E402
                                    add_training_args, config_from_args, exit_on_config_error,
                                    resolve_batch)
from megatron_2bw.config import ConfigError  # noqa: E402
from megatron_2bw.parallel.distributed import (default_device, env_rank_world,  # noqa: E402
                                               init_process_group)


def parse(argv=None):
    p = FlagParser(prog="pretrain_gpt.py", description="Pretrain a GPT with a pipeline engine.",
                   allow_abbrev=False)
    add_model_args(p)
    add_parallel_args(p)
    add_training_args(p)
    g = p.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true",
                   help="train on deterministic synthetic sequences")
    args = p.parse_args(argv)
    rank, world_size, local_rank = env_rank_world()

    def build():
        if not args.mock_data:
            raise ConfigError("no training data: pass --mock-data (indexed datasets via "
                              "--data-path are not available in this version)")
        cfg = resolve_batch(config_from_args(args), world_size)
        return cfg.validate(world_size)

    return exit_on_config_error(build), rank, world_size, local_rank


def main(argv=None) -> int:
    cfg, rank, world_size, local_rank = parse(argv)
    backend = init_process_group(rank, world_size, backend=cfg.parallel.backend,
                                 timeout_minutes=cfg.parallel.timeout_minutes)
    from megatron_2bw.training import build_grid, train
    grid = build_grid(cfg, rank, world_size)
    device = default_device(local_rank, backend)
    if rank == 0:
        print(f"megatron-2bw: schedule={cfg.schedule} t={grid.tensor} d={grid.pipeline} "
              f"w={grid.data} micro-batch={cfg.batch.micro_batch_size} "
              f"global-batch={cfg.batch.global_batch_size} m={cfg.num_microbatches(world_size)} "
              f"precision={cfg.precision.dtype} backend={backend}", flush=True)
    train(cfg, grid, device, log=lambda line: print(line, flush=True))
    import torch.distributed as dist
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
