"""Reading torch_dist checkpoints: into an engine of any layout (each rank reads its own boxes,
resharded by DCP), or whole in one process (tools, converters).

    view = stage_boxes(engine, cfg, grid)              # the stage's boxes of global tensors
    payload = read_engine_state(dir, engine, view, grid, load_optim=True)
    engine.load_state_dict(payload["engine"])           # as if this layout had saved it
    common = read_common(dir)                           # iteration, layout, config ... (small)
    tensors = read_full(dir, prefix="model.")           # full tensors by global name
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from megatron_2bw.checkpoint.dist.save import COMMON, rng_key
from megatron_2bw.checkpoint.dist.shards import (MODEL, OPTIMIZER, PREVIOUS, ParamBox, Shard,
                                                 empty_state, param_boxes, state_shards)
from megatron_2bw.checkpoint.dist.storage import (CHECKSUMS, METADATA, file_problem, plan_read,
                                                  read_boxes, read_checksums, read_metadata,
                                                  run_read, verify_file)
from megatron_2bw.checkpoint.files import CheckpointError, verify_once
from megatron_2bw.optim.optimizer import OPTIONAL_STATE


@dataclass(frozen=True)
class StageBoxes:
    """A stage's flat layout as boxes of global tensors."""
    params: list[ParamBox]
    numel: int


def stage_boxes(engine, cfg, grid) -> StageBoxes:
    from megatron_2bw.checkpoint.names import one_process_names
    with torch.random.fork_rng(devices=[]):  # building the meta model draws nothing we keep
        renames = one_process_names(cfg, engine.weights.modules[0])
    numel = sum(math.prod(shape) for shape in engine.weights.shapes)  # unpadded: the state's
    return StageBoxes(param_boxes(engine.weights, renames, grid.tp_rank, grid.tensor), numel)


def is_dist_checkpoint(directory: str) -> bool:
    """Whether an iteration directory holds the torch_dist format (else Megatron's torch)."""
    if not os.path.isdir(directory):
        return False
    return any(name in (METADATA, COMMON, CHECKSUMS) or name.endswith(".distcp")
               for name in os.listdir(directory))


def read_common(directory: str, sums: dict | None = None, verify: bool = True) -> dict:
    """The checkpoint's common state (common.pt: iteration, data position, schedule, loss
    scaler, optimizer step count, config, layout), checksum verified first unless `verify` is
    False (checked already)."""
    if verify:
        verify_file(directory, COMMON, read_checksums(directory) if sums is None else sums)
    path = os.path.join(directory, COMMON)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - unpickling a damaged file fails in many ways
        raise CheckpointError(f"cannot read checkpoint file {path} ({type(e).__name__}): load "
                              "an earlier iteration") from None


def _optimizer_name(common: dict) -> str | None:
    return ((common.get("config") or {}).get("optimizer") or {}).get("name")


def read_engine_state(directory: str, engine, view: StageBoxes, grid, cfg,
                      load_optim: bool = True, check_common=None) -> dict:
    """Collective: this rank's engine state from the torch_dist checkpoint in `directory`,
    whatever layout and schedule saved it: a payload shaped like a torch-format stage file
    ({"engine": state for `PipelineEngine.load_state_dict`, "iteration", "consumed_samples",
    "layout", "config", "rng", "common"}). The 2BW previous version is read when both runs keep
    two versions (the engine falls back to the newest otherwise); the optimizer's buffers when
    `load_optim` and the checkpoint holds them; the RNG state of this rank's coordinates when it
    exists. `check_common(common)` may refuse the checkpoint (CheckpointError).

    Each file is hashed once in the job, before anything reads it (files.verify_once): common.pt
    and .metadata by one rank each, then every .distcp by one of the ranks that read it; every
    rank raises the same first problem."""
    problem, sums = None, {}
    try:
        sums = read_checksums(directory)
    except CheckpointError as e:
        problem = str(e)
    verify_once([COMMON, METADATA], grid, lambda name: file_problem(directory, name, sums),
                problem, shared=True)
    read, files = None, []
    try:
        common = read_common(directory, verify=False)
        if check_common is not None:
            check_common(common)
        metadata = read_metadata(directory, verify=False)
        keys = metadata.state_dict_metadata
        previous = engine.weights.num_slots > 1 and any(k.startswith(PREVIOUS) for k in keys)
        want_optim = load_optim and common.get("optimizer") is not None
        if want_optim and _optimizer_name(common) != cfg.optimizer.name:
            raise CheckpointError(f"checkpoint {directory} was saved with --optimizer "
                                  f"{_optimizer_name(common)}, this run uses --optimizer "
                                  f"{cfg.optimizer.name}: use the same optimizer, or pass "
                                  "--no-load-optim to start its state fresh")
        buffers = empty_state(view.numel, engine.weights.dtype if previous else None,
                              engine.optimizer.state_dict() if want_optim else {})
        _drop_unsaved(buffers["optimizer"], keys)
        targets, _ = state_shards(buffers, view.params, view.numel, reading=True)
        key = rng_key(grid)
        read = plan_read(directory, targets, [key] if key in keys else [], metadata)
        files = read.files
    except CheckpointError as e:
        problem = str(e)
    verify_once(files, grid, lambda name: file_problem(directory, name, sums), problem)
    objects = run_read(read)
    state = {"iteration": common["iteration"], "schedule": common["schedule"],
             "names": list(engine.weights.names), "newest": buffers["newest"],
             "scaler": common["scaler"], "skipped": common["skipped"]}
    if previous:
        state["previous"] = buffers["previous"]
    if want_optim:
        state["optimizer"] = {**buffers["optimizer"], **common["optimizer"]}
    return {"engine": state, "iteration": common["iteration"],
            "consumed_samples": common["consumed_samples"], "layout": common["layout"],
            "config": common["config"], "rng": objects.get(key), "common": common}


def _drop_unsaved(optimizer: dict, keys) -> None:
    """Leave out of the buffers to read (flat or pieces form) the optional optimizer buffers
    (`OPTIONAL_STATE`: Adam's kept gradient) the checkpoint lacks (saved by another
    --2bw-compensation or an older version): the optimizer's load_state_dict fills them in."""
    saved = {k[len(OPTIMIZER):].split(".", 1)[0] for k in keys if k.startswith(OPTIMIZER)}
    for entry in [optimizer, *optimizer.get("pieces", ())]:
        for key in OPTIONAL_STATE:
            if key not in saved:
                entry.pop(key, None)


def read_full(directory: str, prefix: str = MODEL) -> dict[str, torch.Tensor]:
    """Every tensor whose global name starts with `prefix`, whole, by name without the prefix
    (one process; the converters' and tools' reader)."""
    sums = read_checksums(directory)
    metadata = read_metadata(directory, sums)
    targets = [Shard(name, torch.empty(tuple(md.size), dtype=md.properties.dtype,
                                      device="cpu"),
                     tuple(md.size), (0,) * len(md.size))
               for name, md in metadata.state_dict_metadata.items()
               if name.startswith(prefix) and hasattr(md, "size")]
    read_boxes(directory, targets, [], sums, metadata)
    return {s.name[len(prefix):]: s.tensor for s in targets}


__all__ = ["StageBoxes", "stage_boxes", "is_dist_checkpoint", "read_common",
           "read_engine_state",
           "read_full", "MODEL", "PREVIOUS", "OPTIMIZER"]
