"""Resuming on a new allocation: what --load's checkpoint was saved with, against this run's
layout, before any process group (pretrain.parse, after --auto-plan chose the layout).

    note = resume_note(cfg, world_size, planned=args.auto_plan)   # a line for the log, or None

A checkpoint of another model (checkpoint/layout.py: every setting that changes what its tensors
mean) is a one-line CheckpointError naming both values and the flags. A torch_dist checkpoint
loads into any (t, d, w) and schedule: the note says what changed. A torch-format one loads only
into the layout that saved it: another layout is a one-line CheckpointError naming both and the
conversion. Either way the data position must survive:
a global batch that differs from the checkpoint's would resume from other samples (an error).
"""
from __future__ import annotations

import os

import torch

from megatron_2bw.checkpoint.dist.load import is_dist_checkpoint, read_common
from megatron_2bw.checkpoint.files import CheckpointError, iteration_dir, latest_iteration
from megatron_2bw.checkpoint.layout import check_layout, saved_layout
from megatron_2bw.checkpoint.torch_format import first_stage_file, record_problem
from megatron_2bw.config import Config
from megatron_2bw.schedule.compensation_methods import (NONE as NO_COMPENSATION, Predict,
                                                        compensation_method, method_names)
from megatron_2bw.schedule.kinds import schedule_kind


def _saved(load: str, it: int) -> tuple[str, dict, int, dict | None, dict | None]:
    """(format, {tensor, pipeline, data, world, schedule, compensation} as saved, consumed
    samples, a Megatron checkpoint's common state or None, our own record of the model or None:
    common.pt, the first stage file's payload, our Megatron export's record)."""
    from megatron_2bw.checkpoint.megatron.detect import OURS_KEY, detect
    directory = iteration_dir(load, it)
    found = detect(directory)
    if found.foreign:
        from megatron_2bw.checkpoint.megatron.resume_check import saved
        fmt, parallel, consumed, state = saved(directory, found)
        return fmt, parallel, consumed, state, state.get(OURS_KEY)
    if is_dist_checkpoint(directory):
        common = read_common(directory)
        return ("torch_dist", dict(common.get("parallel") or {}), common["consumed_samples"],
                None, common)
    path = first_stage_file(load, it)
    problem = record_problem(path)  # what torch.load unpickles, checked first (zip's CRC-32)
    if problem:
        raise CheckpointError(f"--load {load}: {problem}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - a file that matches its checksum but not torch
        raise CheckpointError(f"--load {load}: cannot read checkpoint file {path} "
                              f"({type(e).__name__}): load an earlier iteration") from None
    lay = payload.get("layout") or {}
    return "torch", {"tensor": lay.get("tensor"), "pipeline": lay.get("pipeline"),
                     "schedule": payload["engine"]["schedule"],
                     "compensation": (payload.get("parallel") or {}).get("compensation")
                     }, payload["consumed_samples"], None, payload


def saved_config(load: str) -> tuple[int, dict] | None:
    """(iteration, the Config.to_dict() it was saved with) of the newest checkpoint in `load`, in
    either format; None when it holds none (--use-checkpoint-args)."""
    it = latest_iteration(load) if os.path.isdir(load) else None
    if it is None:
        return None
    directory = iteration_dir(load, it)
    from megatron_2bw.checkpoint.megatron.detect import detect
    found = detect(directory)
    if found.foreign:
        from megatron_2bw.checkpoint.megatron.common import args_of, model_settings
        from megatron_2bw.checkpoint.megatron.resume_check import foreign_state
        state = foreign_state(directory, found)
        ours = state.get("megatron_2bw")
        if ours:
            return it, dict(ours.get("config") or {})
        return it, {"model": model_settings(args_of(state), "gpt")[0]}
    if is_dist_checkpoint(directory):
        return it, dict(read_common(directory).get("config") or {})
    path = first_stage_file(load, it)
    problem = record_problem(path)
    if problem:
        raise CheckpointError(f"--load {load}: {problem}")
    payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    return it, dict(payload.get("config") or {})


def _describe(p: dict) -> str:
    w = p.get("data")
    ranks = f" on {p['world']} ranks" if p.get("world") else ""
    comp = p.get("compensation")
    comp = f"+{comp}" if comp not in (None, NO_COMPENSATION) else ""
    return (f"t={p.get('tensor')} d={p.get('pipeline')} w={w if w is not None else '?'} "
            f"{p.get('schedule')}{comp}{ranks}")


def resume_note(cfg: Config, world_size: int, planned: bool = False) -> str | None:
    """A line saying how resuming from --load changes the layout (None when nothing does or
    there is nothing to resume); a one-line CheckpointError when it cannot resume."""
    load = cfg.train.load
    it = latest_iteration(load) if load and os.path.isdir(load) else None
    if it is None:
        return None
    fmt, saved, consumed, foreign, record = _saved(load, it)
    if record is not None:  # the model: load's own check, here before any process group
        check_layout(saved_layout(record), cfg, cfg.parallel, iteration_dir(load, it),
                     resharding=True)
    if foreign is not None:
        from megatron_2bw.checkpoint.megatron.resume_check import resume_problems
        resume_problems(cfg, foreign, load)
    ours = {"tensor": cfg.parallel.tensor, "pipeline": cfg.parallel.pipeline,
            "data": cfg.data_parallel_size, "world": world_size, "schedule": cfg.schedule,
            "compensation": cfg.compensation}
    how = " (chosen by --auto-plan)" if planned else ""
    B, ours_consumed = cfg.global_batch_size, cfg.batch_plan.consumed(it)
    if not cfg.train.finetune and consumed is not None and consumed != ours_consumed:
        if cfg.batch_plan.ramps or consumed % max(it, 1):  # a ramp, here or in that run
            raise CheckpointError(f"--load {load} consumed {consumed} samples in {it} "
                                  f"iterations, this run's batches consume {ours_consumed} in "
                                  "them and would resume from other samples: give the batch "
                                  "flags (global batch, batch-size ramp) of the run that saved it")
        raise CheckpointError(f"--load {load} consumed {consumed} samples in {it} iterations "
                              f"(global batch {consumed // max(it, 1)}); this run's global batch "
                              f"{B} would resume from other samples: use --global-batch-size "
                              f"{consumed // max(it, 1)}")
    moved = [k for k in ("tensor", "pipeline") if saved.get(k) != ours[k]]
    if fmt == "torch" and moved:
        raise CheckpointError(f"--load {load} holds a torch-format checkpoint (iteration {it}) "
                              f"saved with t={saved['tensor']} d={saved['pipeline']}; it loads "
                              f"only into that layout, this run is t={ours['tensor']} "
                              f"d={ours['pipeline']}{how}: convert it with "
                              f"tools/checkpoint_convert.py to-dist --load {load} --save NEW "
                              "and --load NEW, or use matching flags")
    changed = [k for k in ("tensor", "pipeline", "data", "world", "schedule", "compensation")
               if saved.get(k) is not None and saved[k] != ours[k]]
    if not changed:
        return None
    note = (f"resuming iteration {it} of --load {load} ({fmt}) saved with {_describe(saved)}, "
            f"now {_describe(ours)}{how}: {', '.join(changed)} changed")
    if fmt.startswith("Megatron torch format"):
        note += "; every rank reads the whole checkpoint (its format is per stage and tensor " \
            "rank) and keeps its own shards"
    elif "tensor" in changed or "pipeline" in changed or "data" in changed:
        note += "; every rank reads its own shards of the global tensors"
    if saved.get("schedule") and saved["schedule"] != cfg.schedule:
        before, now = schedule_kind(saved["schedule"]), schedule_kind(cfg.schedule)
        if before.num_slots > now.num_slots:
            note += f"; {cfg.schedule} continues from the newest weights W({it})"
        elif before.num_slots < now.num_slots:
            note += (f"; the checkpoint holds one weight version, so {cfg.schedule}'s first "
                     f"batch runs on W({it}) instead of W({it - 1})")
    if "compensation" in changed and "schedule" not in changed and \
            schedule_kind(cfg.schedule).num_slots > 1:
        note += (f"; batch {it} runs on the version the checkpoint saved for it ("
                 f"{_runs_on(saved['compensation'], it)}), later batches on "
                 f"{_runs_on(cfg.compensation, '...')}")
        if _keeps_grad(cfg.compensation) and not _keeps_grad(saved["compensation"]):
            note += (f"; the checkpoint keeps no gradient, so batch {it + 1} runs on the "
                     f"{Predict.name} prediction (the optimizer's last_grad starts as its "
                     "momentum)")
    return note


def _keeps_grad(compensation: str) -> bool:
    return compensation in method_names() and compensation_method(compensation).keeps_grad


def _runs_on(compensation: str, it) -> str:
    """What a 2BW batch `it` runs on under `compensation` (pipeline/compensation.py)."""
    if compensation == NO_COMPENSATION:
        return f"W({it - 1})" if isinstance(it, int) else "W(t-1)"
    return (f"the {compensation} prediction of W({it})" if isinstance(it, int)
            else f"the {compensation} prediction of W(t)")
