"""DeepSpeed's names on gloo processes: PipelineParallelGrid (the `mpu`) laid out as its topology
says, deepspeed.comm basics, log_dist's rank filter, and the engine attributes scripts read."""
import logging
import os
import tempfile

import pytest
import torch
from torch import nn

import megatron_2bw as deepspeed
from megatron_2bw.config import ConfigError
from megatron_2bw.deepspeed.pipe import PipeDataParallelTopology, ProcessTopology
from megatron_2bw.deepspeed.runtime.pipe.topology import PipelineParallelGrid, default_topology
from megatron_2bw.training.spawn import spawn


def _save(obj, outdir, rank):
    torch.save(obj, os.path.join(outdir, f"{rank}.pt"))


def _load(outdir, world):
    return [torch.load(os.path.join(outdir, f"{r}.pt"), weights_only=False) for r in range(world)]


def _grid_worker(rank, world, outdir):
    dist = deepspeed.comm
    out = {}
    for name, topo in (("pipe-data", PipeDataParallelTopology(num_pp=2, num_dp=2)),
                       ("data-pipe", ProcessTopology(["data", "pipe"], [2, 2])),
                       ("default", None)):
        grid = PipelineParallelGrid(topology=topo)
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=grid.get_data_parallel_group())
        out[name] = {
            "stage": grid.get_stage_id(), "dp": grid.get_data_parallel_id(),
            "first": grid.is_first_stage, "last": grid.is_last_stage,
            "to_global": [grid.stage_to_global(s) for s in range(2)],
            "dp_ranks": grid.get_data_parallel_group_ranks(), "dp_sum": t.item(),
            "pipe_size": grid.get_pipe_parallel_world_size(),
            "model_rank": grid.get_model_parallel_rank(),
            "model_size": grid.get_model_parallel_world_size(),
            "slice": (grid.get_slice_parallel_rank(), grid.get_slice_parallel_world_size()),
            "p2p": grid.p2p_groups}
    values = {}
    for op in ("SUM", "AVG", "MAX", "MIN"):
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        values[op] = t.item()
    b = torch.tensor([float(rank)])
    dist.broadcast(b, src=3)
    dist.barrier()
    values["broadcast"] = b.item()
    values["rank_world"] = (dist.get_rank(), dist.get_world_size())
    dp = PipelineParallelGrid(topology=PipeDataParallelTopology(num_pp=2, num_dp=2))
    group = dp.get_data_parallel_group()
    values["in_group"] = (dist.get_rank(group=group), dist.get_world_size(group=group),
                          dist.get_all_ranks_from_group(group),
                          dist.get_global_rank(group, 1))
    try:
        dist.scatter(t)
    except ConfigError as e:
        values["scatter_refused"] = str(e)
    with pytest.raises(ConfigError):
        PipelineParallelGrid(topology=PipeDataParallelTopology(num_pp=2, num_dp=1))
    out["comm"] = values
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    deepspeed.utils.logger.addHandler(handler)
    deepspeed.utils.log_dist("only rank 1", ranks=[1])
    deepspeed.utils.log_dist("every rank", ranks=[-1])
    out["logged"] = [r.getMessage() for r in records]
    _save(out, outdir, rank)


def test_pipeline_parallel_grid_comm_and_log_dist():
    with tempfile.TemporaryDirectory() as d:
        spawn(_grid_worker, 4, args=(d,), timeout_minutes=2)
        res = _load(d, 4)
    for name, topo in (("pipe-data", PipeDataParallelTopology(num_pp=2, num_dp=2)),
                       ("data-pipe", ProcessTopology(["data", "pipe"], [2, 2])),
                       ("default", default_topology(4))):
        for rank, r in enumerate(res):
            g, coord = r[name], topo.get_coord(rank)
            assert (g["stage"], g["dp"]) == (coord.pipe, coord.data), (name, rank)
            assert (g["first"], g["last"]) == (coord.pipe == 0, coord.pipe == 1)
            assert g["to_global"] == [topo.get_rank(pipe=s, data=coord.data) for s in (0, 1)]
            assert sorted(g["dp_ranks"]) == sorted(topo.get_axis_list("pipe", coord.pipe))
            assert g["dp_sum"] == sum(topo.get_axis_list("pipe", coord.pipe))
            replica = sorted(topo.get_axis_list("data", coord.data))
            assert (g["model_rank"], g["model_size"]) == (replica.index(rank), 2)
            assert g["pipe_size"] == 2 and g["slice"] == (0, 1)
            peer = topo.get_rank(pipe=1 - coord.pipe, data=coord.data)
            assert g["p2p"][rank] == [rank, peer]
    assert default_topology(4).get_dim("pipe") == 2 and default_topology(6).get_dim("data") == 3
    for rank, r in enumerate(res):
        c = r["comm"]
        assert (c["SUM"], c["AVG"], c["MAX"], c["MIN"]) == (10.0, 2.5, 4.0, 1.0)
        assert c["broadcast"] == 3.0 and c["rank_world"] == (rank, 4)
        ranks = c["in_group"][2]  # the data-parallel group of this rank's stage
        assert rank in ranks and c["in_group"] == (ranks.index(rank), 2, ranks, ranks[1])
        assert c["scatter_refused"] == "deepspeed.comm.scatter is not in the megatron_2bw " \
            "drop-in: use broadcast (every rank receives the whole tensor) and take its part"
        want = ["[Rank 1] only rank 1"] if rank == 1 else []
        assert r["logged"] == want + [f"[Rank {rank}] every rank"]


def _engine_worker(rank, world, outdir):
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 1)]
    total = sum(p.numel() for layer in layers for p in layer.parameters())
    net = deepspeed.pipe.PipelineModule(layers=layers, num_stages=2, loss_fn=nn.MSELoss())
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "steps_per_print": 100,
              "fp16": {"enabled": False, "loss_scale": 128},
              "zero_optimization": {"stage": 0}, "pipeline": {"schedule": "flush"},
              "activation_checkpointing": {"number_checkpoints": 2}}
    deepspeed.checkpointing.reset()
    eng, _, _, _ = deepspeed.initialize(model=net, config=config)
    data = [(torch.randn(2, 8), torch.randn(2, 1)) for _ in range(4)]
    for _ in range(2):
        eng.train_batch(iter(data))
    mine = torch.tensor([float(sum(p.numel() for p in eng.parameters()))])
    deepspeed.comm.all_reduce(mine)
    _save({"params": mine.item(), "total": total, "loss_scale": eng.loss_scale(),
           "zero": eng.zero_optimization_stage(), "config": eng.config,
           "steps": eng.global_steps, "samples": eng.global_samples,
           "monitor": eng.monitor.enabled,
           "ckpt_configured": deepspeed.checkpointing.is_configured(),
           "named": len(list(eng.named_parameters())) == len(list(eng.parameters()))},
          outdir, rank)


def test_engine_attributes_scripts_read():
    with tempfile.TemporaryDirectory() as d:
        spawn(_engine_worker, 2, args=(d,), timeout_minutes=2)
        res = _load(d, 2)
    for r in res:
        assert r["params"] == r["total"]          # the stages' parameters() cover the model
        assert (r["loss_scale"], r["zero"], r["steps"], r["samples"]) == (128, 0, 2, 8)
        assert r["config"]["pipeline"] == {"schedule": "flush"} and r["monitor"] is False
        assert r["ckpt_configured"]    # the activation_checkpointing section configures it
        assert r["named"]
