"""`deepspeed.runtime.pipe.topology`: DeepSpeed's topologies and `PipelineParallelGrid`.

`PipelineParallelGrid(topology)` is the grid of the running job (the process group must be up):
the training loop's grid (parallel/grid.py `ProcessGrid.from_config`) laid out as the topology says
(deepspeed/pipe/topology.py `grid_layout`), its groups created through the communication layer,
queried with DeepSpeed's `mpu` methods (deepspeed/views.py `MPU`: get_stage_id,
get_data_parallel_group, stage_to_global, ...). Without a topology the world is split as
DeepSpeed splits it: its prime factors alternately to the pipeline and to data parallelism.
"""
from __future__ import annotations

import dataclasses

from megatron_2bw.config import Config, ConfigError
from megatron_2bw.config.launcher_env import env_rank_world
from megatron_2bw.deepspeed.pipe.topology import (PipeDataParallelTopology,
                                                  PipeModelDataParallelTopology, ProcessTopology,
                                                  grid_layout)
from megatron_2bw.deepspeed.views import MPU
from megatron_2bw.parallel.comm import Comm
from megatron_2bw.parallel.devices import default_device
from megatron_2bw.parallel.devices import is_initialized
from megatron_2bw.parallel.distributed import current_rank_world
from megatron_2bw.parallel.grid import ProcessGrid


def _prime_factors(n: int) -> list:
    out, p = [], 2
    while p * p <= n:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out + ([n] if n > 1 else [])


def default_topology(world_size: int) -> PipeDataParallelTopology:
    """DeepSpeed's topology when none is given: prime factors alternately to pipe and data."""
    pp = dp = 1
    for i, p in enumerate(_prime_factors(world_size)):
        if i % 2 == 0:
            pp *= p
        else:
            dp *= p
    return PipeDataParallelTopology(num_pp=pp, num_dp=dp)


class PipelineParallelGrid(MPU):
    """The job's process grid under DeepSpeed's name (`process_group` is accepted and unused,
    as in DeepSpeed)."""

    def __init__(self, topology=None, process_group=None):
        if not is_initialized():
            raise ConfigError("PipelineParallelGrid needs the process group: call "
                              "deepspeed.init_distributed() first")
        rank, world = current_rank_world()
        topo = topology if topology is not None else default_topology(world)
        axes = list(topo.get_axis_names())
        dims = [topo.get_dim(a) for a in axes]
        size = 1
        for d in dims:
            size *= d
        if size != world:
            raise ConfigError(f"topology {axes} x {dims} holds {size} ranks but the world has "
                              f"{world}: make the dims multiply to the world size")
        layout = grid_layout(topo)
        base = Config()
        cfg = dataclasses.replace(base, parallel=dataclasses.replace(
            base.parallel, tensor=layout["tensor"], pipeline=layout["pipeline"],
            data=layout["data"], rank_order=layout["rank_order"]))
        comm = Comm()
        device = default_device(env_rank_world()[2], comm.backend)
        grid = ProcessGrid.from_config(cfg, rank, world).init_groups(Comm(device, comm.backend))
        for r in range(world):   # grid_layout's promise: our coordinates are the topology's
            coord = topo.get_coord(r)
            assert grid.coords(r)[1:] == (coord.pipe, getattr(coord, "data", 0)), (r, coord)
        super().__init__(grid, topo)
        self.pipe_groups = topo.get_axis_comm_lists("pipe")
        self.dp_groups = topo.get_axis_comm_lists("data")
        self.p2p_groups = self._build_p2p_groups()

    def _is_grid_valid(self):
        return self.grid.world_size == current_rank_world()[1]

    def _build_p2p_groups(self):
        """[rank, next stage's rank (cyclic)] for every rank, DeepSpeed's p2p pairs."""
        pairs = []
        for rank in range(self.world_size):
            ranks = next(g for g in self.pipe_groups if rank in g)
            pairs.append([rank, ranks[(ranks.index(rank) + 1) % len(ranks)]])
        return pairs


__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "PipelineParallelGrid",
           "ProcessTopology", "default_topology"]
