"""This project's checkpoints as one full model: the converters' native reader and writer.

    read_checkpoint(dir)                       -> FullModel at the newest (or a given) iteration
    write_checkpoint(dir, model, t, d)         -> iteration 0 of `model` for the layout (t, d)

A FullModel is the config a model was trained with plus every parameter as one full fp32 tensor,
named as in the one-process model (`layers.<spec index>.<name>`, a tied embedding once under its
first name, `layers.0.word_embeddings.weight`). Any layout reads the same: each stage file
(checkpoint/files.py) holds the stage's newest fp32 weights as one flat buffer with its parameter
names (pipeline/weights.py; under 2BW the newest version, not the one the next batch runs on).
Shapes and tensor-parallel split dims come from building the stage on the meta device (no
memory), tensor shards are merged by `tensor_parallel.shards.merge_tensor_shards` (concatenation
along each parameter's `partition_dim`), and parameter names are global already, so stages only need
their tied copies renamed. Writing is the inverse: split every full tensor into the chunk a stage of
rank r holds (the chunk `tensor_parallel.layers.sharded_normal` initializes) and flatten the
stage's parameters in the engine's order (`VersionedWeights._ordered_params`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from types import SimpleNamespace

import torch

from megatron_2bw.checkpoint.dist.load import MODEL, is_dist_checkpoint, read_common, read_full
from megatron_2bw.checkpoint.files import (FILENAME, CheckpointError, iteration_dir,
                                           latest_iteration, rank_dir, read_checkpoint_file,
                                           write_latest, write_with_checksum)
from megatron_2bw.checkpoint.layout import config_from_dict, layout
from megatron_2bw.checkpoint.names import (canonical, single_process, stage_module, tied_renames,
                                           with_layout)
from megatron_2bw.checkpoint.torch_format import first_stage_file, legacy_names
from megatron_2bw.config import BatchConfig, Config
from megatron_2bw.models.families import model_parts
from megatron_2bw.models.stage import StageModule
from megatron_2bw.optim.loss_scale import make_loss_scaler
from megatron_2bw.pipeline.weights import VersionedWeights
from megatron_2bw.tensor_parallel.shards import merge_tensor_shards, split_shard


@dataclass
class FullModel:
    config: Config
    state: dict[str, torch.Tensor]   # full fp32 tensors by one-process parameter name
    iteration: int = 0


# -- read ------------------------------------------------------------------------------------------
def _load(path: str) -> dict:
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint file {path} is missing: the checkpoint is incomplete")
    return read_checkpoint_file(path)


def read_checkpoint(load_dir: str, iteration: int | None = None) -> FullModel:
    """The full model of the checkpoint in `load_dir` (any layout; the newest iteration unless
    one is given); one-line CheckpointError when it cannot be read."""
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"{load_dir} is not a checkpoint directory: fix the path")
    it = latest_iteration(load_dir) if iteration is None else iteration
    if it is None:
        raise CheckpointError(f"{load_dir} holds no checkpoint (no "
                              "latest_checkpointed_iteration.txt): pass the --save directory")
    if iteration is not None and not os.path.isdir(iteration_dir(load_dir, it)):
        held = sorted(int(n[5:]) for n in os.listdir(load_dir)
                      if n.startswith("iter_") and n[5:].isdigit())
        if not held:
            raise CheckpointError(f"{load_dir} holds no checkpoint (no iter_* directory): "
                                  "pass the --save directory")
        raise CheckpointError(f"{load_dir} holds no iteration {iteration} (it holds "
                              f"{', '.join(map(str, held))}): give one of them to --iteration, "
                              "or leave it out for the newest")
    if is_dist_checkpoint(iteration_dir(load_dir, it)):
        return _read_dist(iteration_dir(load_dir, it), it)
    first = _load(first_stage_file(load_dir, it))
    t, d = first["layout"]["tensor"], first["layout"]["pipeline"]
    cfg = config_from_dict(first["config"])
    results = []
    for stage in range(d):
        for r in range(t):
            payload = _load(os.path.join(rank_dir(load_dir, it, r, stage, d), FILENAME))
            module = stage_module(cfg, t, r, d, stage)
            results.append(_unflatten(payload["engine"], module, stage, r))
    problems: list[str] = []
    merged = merge_tensor_shards(results, problems)
    if problems:
        raise CheckpointError(f"checkpoint {load_dir} iteration {it}: {problems[0]}")
    shapes, tied_names = canonical(cfg)
    state: dict[str, torch.Tensor] = {}
    for res in merged:
        renames = tied_renames(res["tied"], tied_names)
        for name, value in res["params"].items():
            state.setdefault(renames.get(name, name), value)
    missing = sorted(set(shapes) - set(state))
    if missing:
        raise CheckpointError(f"checkpoint {load_dir} iteration {it} lacks {missing[0]}: it "
                              "was written by another version of the model code")
    return FullModel(cfg, {n: state[n] for n in shapes}, it)


def _read_dist(directory: str, it: int) -> FullModel:
    """A torch_dist checkpoint's newest weights: its tensors are whole and named globally."""
    cfg = config_from_dict(read_common(directory)["config"])
    tensors = read_full(directory, MODEL)
    shapes, _ = canonical(cfg)
    missing = sorted(set(shapes) - set(tensors))
    if missing:
        raise CheckpointError(f"checkpoint {directory} lacks {missing[0]}: it was written by "
                              "another version of the model code")
    return FullModel(cfg, {n: tensors[n].float() for n in shapes}, it)


def _unflatten(engine: dict, module: StageModule, stage: int, tp_rank: int) -> dict:
    params = dict(module.named_parameters())
    names = legacy_names(list(engine["names"]))
    if sorted(names) != sorted(params):
        extra = sorted(set(names) ^ set(params))
        raise CheckpointError(f"stage {stage} of the checkpoint does not match the model its "
                              f"config describes ({extra[0]}): it was written by another version "
                              "of the model code")
    flat, out, offset = engine["newest"], {}, 0
    for name in names:
        shape = params[name].shape
        out[name] = flat[offset:offset + shape.numel()].view(shape).float()
        offset += shape.numel()
    return {"params": out, "stage": stage, "dp": 0, "tp": tp_rank,
            "partition_dims": {n: getattr(p, "partition_dim", None) for n, p in params.items()},
            "tied": module.tied_parameter_names()}


# -- write -----------------------------------------------------------------------------------------
def write_checkpoint(save_dir: str, model: FullModel, tensor: int = 1, pipeline: int = 1) -> str:
    """Write `model` as iteration 0 of a checkpoint for tensor size `tensor` and `pipeline`
    stages into `save_dir` (which must hold no checkpoint yet); returns the directory."""
    cfg = with_layout(model.config, tensor, pipeline)
    # the model and layout rules; the batch settings do not matter here
    replace(cfg, batch=BatchConfig(micro_batch_size=1, global_batch_size=4 * pipeline)).validate()
    if os.path.isdir(save_dir) and latest_iteration(save_dir) is not None:
        raise CheckpointError(f"{save_dir} already holds a checkpoint (iteration "
                              f"{latest_iteration(save_dir)}): write into an empty directory")
    shapes, tied_names = canonical(cfg)
    for name, shape in shapes.items():
        have = model.state.get(name)
        if have is None or have.shape != shape:
            what = "is missing" if have is None else f"has shape {tuple(have.shape)}"
            raise CheckpointError(f"parameter {name} {what}, the model needs {tuple(shape)}")
    grid = SimpleNamespace(tensor=tensor, pipeline=pipeline)
    scaler = make_loss_scaler(cfg.precision).state_dict()
    for stage in range(pipeline):
        for r in range(tensor):
            module = stage_module(cfg, tensor, r, pipeline, stage)
            params, names = VersionedWeights._ordered_params(module, module.tied)
            renames = tied_renames(module.tied_parameter_names(), tied_names)
            flat = torch.cat([split_shard(model.state[renames.get(n, n)].float(),
                                          getattr(p, "partition_dim", None), tensor, r)
                              .reshape(-1) for p, n in zip(params, names)])
            engine = {"iteration": 0, "schedule": cfg.schedule, "names": names,
                      "newest": flat.contiguous(), "scaler": scaler, "skipped": 0}
            payload = {"engine": engine, "iteration": 0, "consumed_samples": 0,
                       "layout": layout(cfg, grid), "config": cfg.to_dict(),
                       "rng": {"cpu": torch.get_rng_state()}}
            path = os.path.join(rank_dir(save_dir, 0, r, stage, pipeline), FILENAME)
            write_with_checksum(path, lambda f, payload=payload: torch.save(payload, f))
    write_latest(save_dir, 0)
    return save_dir


def one_process_model(model: FullModel) -> StageModule:
    """The whole model in one module holding `model`'s weights (eval mode), for sampling and
    comparisons."""
    cfg = single_process(model.config)
    specs, _, _ = model_parts(cfg)
    module = StageModule(specs, 0, len(specs), seed=cfg.train.seed)
    first = {id(p): n for n, p in module.named_parameters()}  # a tied one under its first name
    module.load_state_dict({n: model.state[first[id(p)]]
                            for n, p in module.named_parameters(remove_duplicate=False)})
    return module.eval()
