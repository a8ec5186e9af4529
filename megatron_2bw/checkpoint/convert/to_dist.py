"""A torch-format checkpoint (any layout, any version of the model code) as a torch_dist one, in
one process: `tools/checkpoint_convert.py to-dist --load OLD --save NEW`. The whole training
state carries over (newest weights, the 2BW previous version, optimizer buffers and step count,
loss scaler, iteration and data position), so `--load NEW` resumes exactly with any layout.

Each stage file's flat buffers are cut into boxes of global tensors with the stage's layout,
which building the stage on the meta device gives (checkpoint/convert/native.py), the same way an
engine of that layout would (shards.py); boxes held twice (a tied embedding, parameters every tensor
rank holds) are written once.
"""
from __future__ import annotations

import os
from types import SimpleNamespace

from megatron_2bw.checkpoint.dist.load import is_dist_checkpoint
from megatron_2bw.checkpoint.dist.save import DistSave, tmp_dir
from megatron_2bw.checkpoint.dist.shards import param_boxes, state_shards
from megatron_2bw.checkpoint.dist.storage import plan_save
from megatron_2bw.checkpoint.files import (FILENAME, CheckpointError, iteration_dir,
                                           latest_iteration, rank_dir)
from megatron_2bw.checkpoint.torch_format import first_stage_file, read_torch
from megatron_2bw.parallel.comm import Comm
from megatron_2bw.pipeline.faults import NO_FAULTS


def _stage_layout(module) -> SimpleNamespace:
    """The flat layout (names, offsets, shapes, partition dims) an engine gives `module`."""
    from megatron_2bw.pipeline.weights import VersionedWeights
    params, names = VersionedWeights._ordered_params(module, module.tied)
    offsets, n = [], 0
    for p in params:
        offsets.append(n)
        n += p.numel()
    return SimpleNamespace(names=names, offsets=offsets, shapes=[p.shape for p in params],
                           partition_dims=[getattr(p, "partition_dim", None) for p in params],
                           numel=n)


def torch_format_state(load_dir: str, it: int) -> tuple[list, dict]:
    """(every stage file's engine state as boxes of global tensors, the common state a
    torch_dist save writes) of the torch-format checkpoint at iteration `it`."""
    from megatron_2bw.checkpoint.layout import config_from_dict
    from megatron_2bw.checkpoint.names import one_process_names, stage_module
    first = read_torch(first_stage_file(load_dir, it), it)
    cfg = config_from_dict(first["config"])
    t, d = first["layout"]["tensor"], first["layout"]["pipeline"]
    shards, other = [], {}
    for stage in range(d):
        for r in range(t):
            path = os.path.join(rank_dir(load_dir, it, r, stage, d), FILENAME)
            engine = read_torch(path, it)["engine"]
            module = stage_module(cfg, t, r, d, stage)
            flat = _stage_layout(module)
            if list(engine["names"]) != list(flat.names):
                raise CheckpointError(f"checkpoint file {path} does not match the model its "
                                      "config describes: it was written by another version of "
                                      "the model code")
            params = param_boxes(flat, one_process_names(cfg, module), r, t)
            boxes, other = state_shards(engine, params, flat.numel)
            shards += boxes
    common = {key: first[key] for key in ("iteration", "consumed_samples", "layout", "config")}
    common.update(schedule=first["engine"]["schedule"], scaler=first["engine"]["scaler"],
                  skipped=first["engine"]["skipped"], optimizer=other if "optimizer" in
                  first["engine"] else None,
                  parallel={"tensor": t, "pipeline": d, "data": None, "world": None,
                            "schedule": first["engine"]["schedule"]})
    return shards, common


def torch_to_dist(load_dir: str, save_dir: str, iteration: int | None = None) -> int:
    """Write the torch-format checkpoint in `load_dir` (the newest iteration unless given) as a
    torch_dist checkpoint in `save_dir` (which must hold none); returns the iteration."""
    it = latest_iteration(load_dir) if iteration is None else iteration
    if it is None:
        raise CheckpointError(f"{load_dir} holds no checkpoint (no "
                              "latest_checkpointed_iteration.txt): pass a run's --save directory")
    if is_dist_checkpoint(iteration_dir(load_dir, it)):
        raise CheckpointError(f"{load_dir} iteration {it} is a torch_dist checkpoint already: "
                              "nothing to convert; resume from it with --load "
                              f"{load_dir} and any parallel layout")
    check_empty(save_dir)
    shards, common = torch_format_state(load_dir, it)
    write_dist(save_dir, it, shards, {}, common)
    return it


def check_empty(save_dir: str) -> None:
    if os.path.isdir(save_dir) and latest_iteration(save_dir) is not None:
        raise CheckpointError(f"{save_dir} already holds a checkpoint (iteration "
                              f"{latest_iteration(save_dir)}): write into an empty directory")


def write_dist(save_dir: str, it: int, shards: list, objects: dict, common: dict,
               files: dict | None = None) -> None:
    """One process: write `shards` (boxes of global tensors) and `objects` as iteration `it`
    of a torch_dist checkpoint in `save_dir` (common.pt: `common`; `files`: name -> bytes
    beside them), all-or-nothing as a save is, and move `latest`."""
    os.makedirs(save_dir, exist_ok=True)
    grid = SimpleNamespace(comm=Comm(), rank=0)
    planned = plan_save(shards, objects, tmp_dir(save_dir, it), grid.comm)
    DistSave(save_dir, it, grid, planned, common, 0, NO_FAULTS, files).start(False).finish()
