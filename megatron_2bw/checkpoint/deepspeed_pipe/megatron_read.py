"""`--load` of a Megatron-DeepSpeed checkpoint (DeepSpeed's pipeline layout, megatron_ds.py's
names) into an engine of any layout, as checkpoint/megatron/torch_read.py reads Megatron's
torch format: every rank maps the files (nothing is written, --load stays as it is), joins
tensor ranks and cuts its own boxes through mapping.pieces.

    model.<ours>            <- the layer files (or ZeRO's fp32 master of bf16/fp16 runs)
    optimizer.exp_avg.<ours>, exp_avg_sq (Adam), momentum (SGD)
                            <- each stage's optimizer state by parameter name (zero.py), the
                               tied embedding's from the first stage that holds it
    the optimizer's steps   <- its saved step count
    iteration, data         <- the client state's iteration and args.consumed_train_samples
    RNG (same t and d)      <- the client state's rng_state of this rank's stage file
    lr schedule             <- checked, not loaded (Megatron's OptimizerParamScheduler state
                               in lr_scheduler; resume_check.py, as for Megatron-LM's)

Files carry no checksums of ours ("not written by megatron-2bw: files not verified"); each is
checked by zip's CRC-32 of every record once per job (files.zip_problem, verify_once). What
cannot be mapped is one line: "optimizer state restarts: ...".
"""
from __future__ import annotations

import os
from collections import defaultdict

import torch

from megatron_2bw.checkpoint.deepspeed_pipe import files as ds_files
from megatron_2bw.checkpoint.deepspeed_pipe import megatron_ds as mds
from megatron_2bw.checkpoint.deepspeed_pipe.zero import stage_optimizer
from megatron_2bw.checkpoint.dist.shards import MODEL, OPTIMIZER, empty_state, state_shards
from megatron_2bw.checkpoint.files import CheckpointError, verify_once
from megatron_2bw.checkpoint.megatron import mapping
from megatron_2bw.checkpoint.megatron.common import (args_of, check_model, consumed_samples,
                                                     parallel_of)
from megatron_2bw.checkpoint.megatron.dist_read import NOT_VERIFIED, check_key_bias

_KINDS = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "momentum": "momentum_buffer"}


def deepspeed_common(directory: str) -> dict:
    """What the resume check and inspect read (no tensor): the first stage file's client state
    in Megatron-LM's words (args, iteration, checkpoint_version, opt_param_scheduler, the
    optimizer's param groups), and "parallel", "consumed_samples", "precision", "writer",
    "zero"; a layout that is not Megatron-DeepSpeed's GPTModelPipe is one CheckpointError."""
    files = ds_files.tag_files(directory)
    record = ds_files.read_file(files.state(0))
    args = mds.lm_args(args_of(record))
    ds_files.expected_files(files, record)
    mds.check_layers(files, mds.roles(files), args)
    it = ds_files.iteration_of(record)
    state = {"args": args, "iteration": it, "checkpoint_version":
             record.get("checkpoint_version"), "writer": ds_files.writer(record),
             "zero": ds_files.zero_stage(record), "precision": ds_files.precision(record),
             "parallel": parallel_of(args) if args else ds_files.parallel(record, files)}
    state["consumed_samples"] = consumed_samples(state, it) if args else \
        int(record.get("global_samples", 0))
    scheduler = record.get("lr_scheduler")
    if isinstance(scheduler, dict) and "max_lr" in scheduler:  # Megatron's OptimizerParamScheduler
        state["opt_param_scheduler"] = scheduler
    groups = (record.get("optimizer") or {}).get("param_groups")
    if groups is None and files.zero.get(0):
        zero = ds_files.read_file(files.zero[0][min(files.zero[0])]).get(
            "optimizer_state_dict") or {}
        groups = (zero.get("base_optimizer_state") or {}).get("param_groups") \
            if isinstance(zero.get("base_optimizer_state"), dict) else None
    if groups:
        state["optimizer"] = {"param_groups": [{k: v for k, v in g.items() if k != "params"}
                                               for g in groups]}
    return state


def stage_records(files) -> list[list[dict]]:
    """Every stage's state files by tensor rank (as many stages as the first one records)."""
    first = ds_files.read_file(files.state(0), check=False)
    stages = ds_files.parallel(first, files)["pipeline"]
    return [[first if (s, tp) == (0, 0) else ds_files.read_file(files.state(s, tp), check=False)
             for tp in range(files.tensor)] for s in range(stages)]


def _zero_states(files, mp: int, record: dict) -> list[dict]:
    by_dp = files.zero.get(mp, {})
    if not by_dp and not ds_files.zero_stage(record):
        return []
    ranks = int(record.get("dp_world_size") or 1 + max(by_dp, default=0))
    missing = [d for d in range(ranks) if d not in by_dp]
    if missing:
        raise CheckpointError(f"checkpoint {files.directory} lacks the ZeRO file of data-parallel "
                              f"rank {missing[0]} (zero_pp_rank_{missing[0]}_mp_rank_{mp:02d}_"
                              "optim_states.pt): the checkpoint is incomplete")
    return [ds_files.read_file(by_dp[d], check=False)["optimizer_state_dict"]
            for d in sorted(by_dp)]


def full_optimizer(files, by_index: dict, records: list[list[dict]], m, in_thirds: bool,
                   shapes: dict) -> tuple[dict[str, dict[str, torch.Tensor]], int | None,
                                          str | None]:
    """({DeepSpeed's state key: {logical name: whole tensor}}, steps, None) from every stage's
    optimizer state, or ({}, None, why it cannot be mapped). A tensor held by several stages
    (the tied embedding) is taken from the first."""
    tied = mds.OUTPUT not in {r for r, _ in by_index.values()}
    shards = defaultdict(lambda: defaultdict(dict))
    steps, first = set(), 0
    for s, by_tp in enumerate(records):
        last = None
        for tp, record in enumerate(by_tp):
            zero, params = _zero_states(files, s * files.tensor + tp, record), None
            if not zero:  # ZeRO-0: names by module order, the stage's layers found by count
                params, last = _zero0_params(files, by_index, record, s, len(records), first,
                                             tied, tp)
            got, why = stage_optimizer(record, zero, params)
            if got is None:
                return {}, None, f"{why} ({os.path.basename(files.state(s, tp))})"
            steps.add(got.steps)
            for name, state in got.tensors.items():
                logical = mds.module_name(name, by_index)
                if logical is None or (logical, tp) not in shapes:
                    continue
                for key, flat in state.items():
                    t = flat.reshape(shapes[logical, tp])
                    shards[key][logical].setdefault(tp, mds.per_group(logical, t, m)
                                                   if in_thirds else t)
        if last is not None:
            first = last + 1
    if len(steps) > 1:
        return {}, None, f"its stages saved different step counts ({sorted(steps)})"
    return {k: mds.merge(v, m) for k, v in shards.items()}, steps.pop(), None


def _zero0_params(files, by_index, record, s, stages, first, tied, tp):
    """The stage module's parameters (name, shape) and its last layer index: the layer files
    from `first` on whose parameters number as many as its optimizer's param groups hold."""
    want = sum(len(g["params"]) for g in (record.get("optimizer") or {}).get("param_groups", ()))
    buffers = set(record.get("buffer_names") or ())
    holds = tied and (s == 0 or s == stages - 1)
    candidates, seen = [i for i in sorted(files.layers) if i >= first], {}
    for last in candidates[-1:] if s == stages - 1 else candidates:
        params = mds.module_params(files, by_index, first, last, holds, tp, buffers, seen)
        if len(params) == want:
            return params, last
    return [], candidates[-1] if candidates else first


def read_deepspeed(directory: str, engine, view, grid, cfg, load_optim: bool) -> dict:
    """Collective (one verify_once): this rank's engine state from the Megatron-DeepSpeed
    checkpoint in the tag directory `directory`, shaped like torch_read's payload."""
    problem, paths = None, []
    try:
        files = ds_files.tag_files(directory)
        paths = sorted(set(ds_files.expected_files(files, ds_files.read_file(files.state(0)))))
    except CheckpointError as e:
        problem = str(e)
    verify_once(paths, grid, ds_files.zip_problem, problem, shared=True)
    try:
        return _read(directory, files, engine, view, grid, cfg, load_optim)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - files that unpickle into unexpected shapes
        first = str(e).splitlines()[0] if str(e) else ""
        raise CheckpointError(f"cannot read the DeepSpeed checkpoint {directory}: "
                              f"{type(e).__name__}: {first}") from None


def _read(directory, files, engine, view, grid, cfg, load_optim: bool) -> dict:
    m = cfg.model
    notes = [f"checkpoint {directory}: {NOT_VERIFIED}"]
    by_index = mds.roles(files)
    records = stage_records(files)
    args = mds.lm_args(args_of(records[0][0]))
    mds.check_layers(files, by_index, args)
    problems = mds.unsupported(args)
    if problems:
        raise CheckpointError(f"checkpoint {directory} was saved by Megatron-DeepSpeed for "
                              f"another model: {'; '.join(problems)}")
    check_model(args, m, directory)
    in_thirds = mds.thirds(args)
    full, shapes, left = mds.full_weights(files, by_index, m, in_thirds)
    if left:
        notes.append(f"checkpoint {directory}: left out (no parameter of this model): "
                     f"{', '.join(left)}")
    opt, steps, why = {}, None, None
    if load_optim:
        opt, steps, why = full_optimizer(files, by_index, records, m, in_thirds, shapes)
        if why:
            notes.append(f"optimizer state restarts: {why}")
    want = load_optim and not why
    buffers = empty_state(view.numel, None, engine.optimizer.state_dict() if want else {})
    for entry in [buffers["optimizer"], *buffers["optimizer"].get("pieces", ())]:
        entry.pop("last_grad", None)  # Adam's kept gradient: the optimizer fills it in
    _fill(buffers, view, m, full, opt if want else {}, directory, notes)
    it = ds_files.iteration_of(records[0][0])
    engine_state = {"iteration": it, "schedule": cfg.schedule,
                    "names": list(engine.weights.names), "newest": buffers["newest"],
                    "scaler": engine.stepper.scaler.state_dict(),
                    "skipped": int(records[0][0].get("skipped_steps", 0))}
    if want:
        engine_state["optimizer"] = dict(buffers["optimizer"], steps=it if steps is None
                                         else steps)
    parallel = parallel_of(args) if args else ds_files.parallel(records[0][0], files)
    return {"engine": engine_state, "iteration": it,
            "consumed_samples": consumed_samples({"args": args}, it) if args else
            int(records[0][0].get("global_samples", 0)),
            "config": {"precision": {"dtype": ds_files.precision(records[0][0])}},
            "notes": notes, "rng": _rng(records, parallel, grid),
            "common": {"parallel": parallel}, "state": ds_files.client_record(records[0][0])}


def _fill(buffers, view, m, full, opt, directory, notes) -> None:
    """Copy every box this rank holds from the whole tensors (`opt`'s fp32 master for the
    weights where it has one)."""
    ours, _ = state_shards(buffers, view.params, view.numel, reading=True)
    by_name, checks = {x.ours: x for x in mapping.links(m)}, []
    with torch.no_grad():
        _copy(ours, by_name, full, opt, directory, checks)
    check_key_bias(checks, m, directory, notes)


def _copy(ours, by_name, full, opt, directory, checks) -> None:
    for s in ours:
        if s.name.startswith(MODEL):
            link = by_name[s.name[len(MODEL):]]
            theirs = opt.get("fp32", {}).get(link.theirs, full.get(link.theirs))
        else:
            kind, name = s.name[len(OPTIMIZER):].split(".", 1)
            link = by_name[name]
            theirs = opt.get(_KINDS.get(kind, kind), {}).get(link.theirs)
        if theirs is None:
            raise CheckpointError(f"checkpoint {directory} lacks {link.theirs} (this model's "
                                  f"{link.ours}): it was saved for another model (use matching "
                                  "flags)")
        if tuple(theirs.shape) != tuple(link.shape):
            raise CheckpointError(f"checkpoint {directory} holds {link.theirs} with shape "
                                  f"{tuple(theirs.shape)}, this model needs {tuple(link.shape)}: "
                                  "it was saved for another model (use matching flags)")
        for p in mapping.pieces(link, s.offsets, tuple(s.tensor.shape)):
            p.select(s.tensor).copy_(mapping.box(theirs, p.offsets, p.sizes))
        if s.name.startswith(MODEL):
            for o, n in mapping.key_pieces(link, s.offsets, tuple(s.tensor.shape)):
                checks.append((link, mapping.box(theirs, o, n)))


def _rng(records: list[list[dict]], parallel: dict, grid) -> dict | None:
    """This rank's RNG state from its stage file's client state, where (t, d) is the
    checkpoint's (Megatron's rule)."""
    if (parallel.get("tensor"), parallel.get("pipeline")) != (grid.tensor, grid.pipeline) or \
            len(records) != grid.pipeline:
        return None
    rng = records[grid.stage][grid.tp_rank].get("rng_state")
    if isinstance(rng, (list, tuple)):
        rng = rng[grid.dp_rank] if len(rng) > grid.dp_rank else (rng[0] if rng else None)
    if not isinstance(rng, dict) or not torch.is_tensor(rng.get("torch_rng_state")):
        return None
    return {"cpu": rng["torch_rng_state"], "cuda": rng.get("cuda_rng_state")}
