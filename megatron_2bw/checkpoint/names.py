"""Global parameter names: every checkpoint names a tensor as the one-process model does
(`layers.<spec index>.<name>`; a tied embedding once, under its first name), whatever layout
saved it. A stage's names are global already but for its tied copies (`one_process_names`);
shapes and split dims come from building a stage on the meta device (`stage_module`)."""
from __future__ import annotations

from dataclasses import replace

import torch

from megatron_2bw.config import Config
from megatron_2bw.models.families import model_parts
from megatron_2bw.models.stage import StageModule
from megatron_2bw.tensor_parallel import TPGroup


def stage_module(cfg: Config, tensor: int, tp_rank: int, pipeline: int, stage: int
                 ) -> StageModule:
    """The stage's module on the meta device: names, shapes and split dims, no memory."""
    specs, _, partition = model_parts(cfg, TPGroup(None, tp_rank, tensor), pipeline)
    with torch.device("meta"):
        return StageModule(specs, partition[stage], partition[stage + 1], seed=cfg.train.seed)


def canonical(cfg: Config) -> tuple[dict[str, torch.Size], dict[str, str]]:
    """(one-process parameter shapes by name, tied key -> its one-process name)"""
    whole = stage_module(single_process(cfg), 1, 0, 1, 0)
    return ({n: p.shape for n, p in whole.named_parameters()}, whole.tied_parameter_names())


def with_layout(cfg: Config, tensor: int, pipeline: int) -> Config:
    """`cfg` for t = tensor, d = pipeline (even stages, data size from the world)."""
    return replace(cfg, parallel=replace(cfg.parallel, tensor=tensor, pipeline=pipeline,
                                         data=None, partition=None))


def single_process(cfg: Config) -> Config:
    return with_layout(cfg, 1, 1)


def tied_renames(stage_tied: dict[str, str], tied_names: dict[str, str]) -> dict[str, str]:
    """A stage's names of tied copies (key -> name) -> their one-process names."""
    return {name: tied_names[key] for key, name in stage_tied.items()}


def one_process_names(cfg: Config, module: StageModule) -> dict[str, str]:
    """A stage's parameter names that differ in the one-process model (its tied copies) -> the
    one-process names; every other name is global already."""
    return tied_renames(module.tied_parameter_names(), canonical(cfg)[1])
