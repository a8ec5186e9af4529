"""Reading megatron-core torch_dist checkpoints into an engine of any layout, box by box through
the same DCP machinery as our own format (checkpoint/dist/storage.py): the boxes this rank's
state needs (checkpoint/dist/shards.py, our global names) are translated into boxes of
megatron-core's sharded keys (mapping.py: names, stacked layers, QKV, SwiGLU), so every rank reads
only what it holds, from a checkpoint of any megatron-core (t, d) and dp.

    model.<ours>              <- optimizer.state.fp32_param.<key> (plain optimizer, bf16/fp16)
                                 or optimizer.state.param.<key> (distributed, fully_reshardable)
                                 or the model's <key> (fp32 runs; --no-load-optim)
    optimizer.exp_avg.<ours>  <- optimizer.state.exp_avg.<key>; exp_avg_sq alike; SGD's momentum
                                 <- optimizer.state.momentum_buffer.<key>
    the optimizer's steps     <- common.pt: optimizer "common_step" (plain) or param_groups' "step"
                                 (distributed)
    fp16's dynamic loss scale <- common.pt: optimizer "grad_scaler" (unless --no-load-optim)
    RNG (same t and d only)   <- the rng_state object of this rank's (pipeline, tensor) rank

A distributed optimizer saved in its bucket layouts (dp_reshardable, dp_zero_gather_scatter,
fully_sharded_model_space) cannot be cut into our parameters: its optimizer state restarts,
said in one line, as are model tensors no parameter of this model reads ("left out"). A
checkpoint without our checksums.sha256 (every one Megatron writes) is not verified ("not
written by megatron-2bw: files not verified").
"""
from __future__ import annotations

import os

import torch

from megatron_2bw.checkpoint.dist.shards import (MODEL, OPTIMIZER, PREVIOUS, Shard, empty_state,
                                                 state_shards)
from megatron_2bw.checkpoint.dist.storage import (METADATA, file_problem, plan_read,
                                                  read_checksums, read_metadata, run_read)
from megatron_2bw.checkpoint.files import CheckpointError, verify_once
from megatron_2bw.checkpoint.megatron import mapping
from megatron_2bw.checkpoint.megatron.common import (args_of, check_model, loss_scaler_state,
                                                     optimizer_record, optimizer_steps)
from megatron_2bw.checkpoint.megatron.detect import OURS_KEY

OURS_PREFIX = OURS_KEY + "."  # our own keys in a megatron-core checkpoint (export.py)

COMMON = "common.pt"
NOT_VERIFIED = "not written by megatron-2bw: files not verified"
MODEL_SPACE = ("fully_reshardable",)  # distributed optimizer layouts held per model parameter
_STATE = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "momentum": "momentum_buffer"}


def read_megatron_common(directory: str, verified: bool = False) -> dict:
    """common.pt of a megatron-core checkpoint (Megatron's pickles, safely: pickles.py)."""
    from megatron_2bw.checkpoint.megatron.pickles import load_megatron_file as load
    path = os.path.join(directory, COMMON)
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {directory} lacks {COMMON}: the checkpoint is "
                              "incomplete; load an earlier iteration")
    if verified:
        problem = file_problem(directory, COMMON, read_checksums(directory))
        if problem:
            raise CheckpointError(problem)
    try:
        state = load(path)
    except Exception as e:  # noqa: BLE001 - a damaged file fails in many ways
        raise CheckpointError(f"cannot read checkpoint file {path} ({type(e).__name__}): it is "
                              "truncated or corrupted; load an earlier iteration") from None
    return state if isinstance(state, dict) else {}


def _main_prefix(keys, key: str, load_optim: bool) -> str:
    """Where the exact fp32 weights of `key` are: the optimizer's copy, else the model's."""
    if load_optim:
        for prefix in ("optimizer.state.fp32_param.", "optimizer.state.param."):
            if prefix + key in keys:
                return prefix
    return ""


def translate(shards: list[Shard], m, keys, load_optim: bool, stacked: bool
              ) -> tuple[list[Shard], list]:
    """Our boxes (views into the buffers to fill) -> megatron-core's boxes (views of the same
    memory), and the key-bias boxes read to be checked ((link, the tensor they fill))."""
    by_name = {x.ours: x for x in mapping.links(m)}
    L, out, checks = m.num_layers, [], []

    def theirs(key: str, layer, offsets, sizes, tensor, link):
        if layer is None:
            return Shard(key, tensor, link.shape, tuple(offsets))
        return Shard(key, tensor.unsqueeze(0), (L, *link.shape), (layer, *offsets))

    for s in shards:
        if s.name.startswith(PREVIOUS) or s.name.startswith(OPTIMIZER + "last_grad."):
            out.append(Shard(OURS_PREFIX + s.name, s.tensor, s.global_shape, s.offsets))
            continue  # our own boxes (export.py): no Megatron counterpart
        if s.name.startswith(MODEL):
            ours, kind = s.name[len(MODEL):], None
        else:
            kind, ours = s.name[len(OPTIMIZER):].split(".", 1)
        link = by_name[ours]
        key, layer = mapping.dist_key(link.theirs, stacked)
        prefix = _main_prefix(keys, key, load_optim) if kind is None else \
            f"optimizer.state.{_STATE.get(kind, kind)}."
        for p in mapping.pieces(link, s.offsets, tuple(s.tensor.shape)):
            out.append(theirs(prefix + key, layer, p.offsets, p.sizes, p.select(s.tensor), link))
        if kind is None:
            for o, n in mapping.key_pieces(link, s.offsets, tuple(s.tensor.shape)):
                temp = torch.zeros(n)
                out.append(theirs(key, layer, o, n, temp, link))
                checks.append((link, temp))
    return out, checks


def _stacked(m, keys) -> bool:
    """Whether its layers are stacked along a leading axis (megatron-core's default) or saved
    one by one (its singleton_local_shards form)."""
    probe = f"{mapping.block_name(m.family)}.layers.0.self_attention.linear_qkv.weight"
    return mapping.dist_key(probe, True)[0] in keys


def _rng_key(args: dict, grid, ours: dict | None, cfg) -> str | None:
    """This rank's RNG object: ours where our export's layout is this run's, Megatron's where
    its (t, d) is (its own rule); None elsewhere."""
    if ours:
        from megatron_2bw.checkpoint.dist.save import rng_key
        from megatron_2bw.checkpoint.layout import common_parallel
        saved, now = dict(ours.get("parallel") or {}), common_parallel(cfg, grid)
        saved.pop("compensation", None), now.pop("compensation")
        return OURS_PREFIX + rng_key(grid) if saved == now else None
    t, d = args.get("tensor_model_parallel_size"), args.get("pipeline_model_parallel_size")
    if (t, d) != (grid.tensor, grid.pipeline):
        return None
    return f"rng_state/shard_{grid.stage}.{grid.tp_rank}_{d}.{t}"


def optimizer_layout(state: dict, keys) -> tuple[bool, str | None]:
    """(whether the optimizer's tensors can be read per parameter, else why they cannot)."""
    opt = optimizer_record(state)
    if not opt and not any(k.startswith("optimizer.") for k in keys):
        return False, "the checkpoint holds no optimizer state"
    sharding = (state.get("optimizer") or {}).get("param_state_sharding_type") or \
        opt.get("param_state_sharding_type")
    if sharding is not None and sharding not in MODEL_SPACE:
        return False, (f"its distributed optimizer state is in Megatron's {sharding} layout "
                       "(flat buffers of its own bucketing); re-save it in Megatron with "
                       "--dist-ckpt-optim-fully-reshardable to carry Adam's moments over")
    if not any(k.startswith("optimizer.state.exp_avg.") or
               k.startswith("optimizer.state.momentum_buffer.") for k in keys):
        return False, "the checkpoint holds no per-parameter optimizer state"
    return True, None


def read_megatron_dist(directory: str, engine, view, grid, cfg, load_optim: bool,
                       verified: bool) -> dict:
    """Collective: this rank's engine state from the megatron-core checkpoint in `directory`,
    shaped like checkpoint/dist/load.read_engine_state's payload, plus "notes" (lines for the
    log: what was not verified, what restarts)."""
    problem, sums, notes, needed = None, {}, [], {}
    if verified:
        try:
            sums = read_checksums(directory)
        except CheckpointError as e:
            problem = str(e)
        check = lambda name: file_problem(directory, name, sums)  # noqa: E731
    else:
        notes.append(f"checkpoint {directory}: {NOT_VERIFIED}")
        check = lambda name: unverified_problem(directory, name, needed)  # noqa: E731
    verify_once([COMMON, METADATA], grid, check, problem, shared=True)
    read, files, checks, want_optim, rng = None, [], [], False, None
    try:
        state = read_megatron_common(directory)
        args, ours = args_of(state), state.get(OURS_KEY)
        if ours:  # our own export: the layout it was saved for is ours to check
            from megatron_2bw.checkpoint.layout import check_layout, saved_layout
            check_layout(saved_layout(ours), cfg, grid, directory, resharding=True)
        else:
            check_model(args, cfg.model, directory)
            if not args:
                notes.append(f"checkpoint {directory} records no Megatron args: only its "
                             "tensors' names and shapes are checked against this model")
        metadata = read_metadata(directory, verify=False)
        needed.update(bytes_needed(metadata))
        keys = metadata.state_dict_metadata
        left = [] if ours else unread_tensors(keys, cfg.model, _stacked(cfg.model, keys))
        if left:
            notes.append(f"checkpoint {directory}: left out (no parameter of this model): "
                         f"{', '.join(left)}")
        if load_optim:
            want_optim, why = optimizer_layout(state, keys)
            if not want_optim:
                notes.append(f"optimizer state restarts: {why}")
        previous = engine.weights.num_slots > 1 and any(
            k.startswith(OURS_PREFIX + PREVIOUS) for k in keys)
        buffers = empty_state(view.numel, engine.weights.dtype if previous else None,
                              engine.optimizer.state_dict() if want_optim else {})
        if not any(k.startswith(OURS_PREFIX + OPTIMIZER + "last_grad.") for k in keys):
            for entry in [buffers["optimizer"], *buffers["optimizer"].get("pieces", ())]:
                entry.pop("last_grad", None)  # Adam's kept gradient: the optimizer fills it in
        targets, _ = state_shards(buffers, view.params, view.numel, reading=True)
        targets, checks = translate(targets, cfg.model, keys, want_optim,
                                    _stacked(cfg.model, keys))
        rng = _rng_key(args, grid, ours, cfg)
        from megatron_2bw.checkpoint.megatron.pickles import load_megatron_file
        read = plan_read(directory, targets, [rng] if rng in keys else [], metadata,
                         unpickle=load_megatron_file)
        files = read.files
    except CheckpointError as e:
        problem = str(e)
    verify_once(files, grid, check, problem)
    objects = run_read(read)
    check_key_bias(checks, cfg.model, directory, notes)
    payload = _payload(state, args, ours or {}, buffers, previous, want_optim, engine, cfg,
                       objects.get(rng), notes)
    if not ours and load_optim:  # Megatron's fp16 loss scale is optimizer state there
        payload["engine"]["scaler"] = loss_scaler_state(state) or payload["engine"]["scaler"]
    return payload


def _payload(state, args, ours, buffers, previous, want_optim, engine, cfg, rng, notes):
    from megatron_2bw.checkpoint.megatron.common import consumed_samples, parallel_of
    it = int(state.get("iteration", 0))
    engine_state = {"iteration": it, "schedule": ours.get("schedule", cfg.schedule),
                    "names": list(engine.weights.names), "newest": buffers["newest"],
                    "scaler": ours.get("scaler", engine.stepper.scaler.state_dict()),
                    "skipped": ours.get("skipped", 0)}
    if previous:
        engine_state["previous"] = buffers["previous"]
    if want_optim:
        steps = (ours.get("optimizer") or {}).get("steps", optimizer_steps(state))
        engine_state["optimizer"] = dict(buffers["optimizer"], steps=it if steps is None
                                         else steps)
    while isinstance(rng, (list, tuple)):  # [rng_state] (per data rank), as DCP holds it
        rng = rng[0] if rng else None
    if isinstance(rng, dict) and "torch_rng_state" in rng:  # Megatron's
        rng = {"cpu": rng["torch_rng_state"], "cuda": rng.get("cuda_rng_state")}
    return {"engine": engine_state, "iteration": it,
            "consumed_samples": ours.get("consumed_samples", consumed_samples(state, it)),
            "config": ours.get("config") or {"precision": precision_of(args)}, "notes": notes,
            "rng": rng if isinstance(rng, dict) and "cpu" in rng else None,
            "common": {"parallel": parallel_of(args), **ours}, "state": state}


def unread_tensors(keys: dict, m, stacked: bool) -> list[str]:
    """The checkpoint's model tensors that no parameter of this model reads (an args-less
    checkpoint of another model: only names and shapes were checked)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    read = {mapping.dist_key(x.theirs, stacked)[0] for x in mapping.links(m)}
    return sorted(k for k, v in keys.items() if isinstance(v, TensorStorageMetadata)
                  and not k.startswith(("optimizer.", OURS_PREFIX)) and k not in read)


def bytes_needed(metadata) -> dict[str, int]:
    """file -> the bytes its shards end at (DCP's storage index: offset + length of each)."""
    out: dict[str, int] = {}
    for info in metadata.storage_data.values():
        out[info.relative_path] = max(out.get(info.relative_path, 0), info.offset + info.length)
    return out


def unverified_problem(directory: str, name: str, needed: dict) -> str | None:
    """What can be told of a file without checksums: missing, or shorter than the shards the
    checkpoint's .metadata places in it (truncated)."""
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        return f"checkpoint file {path} is missing: the checkpoint is incomplete"
    size, want = os.path.getsize(path), needed.get(name, 0)
    if size < want:
        return (f"checkpoint file {path} is truncated ({size} bytes, its shards end at "
                f"{want}): copy it again or load another checkpoint")
    return None


def precision_of(args: dict) -> dict:
    dtype = "fp16" if args.get("fp16") else "bf16" if args.get("bf16") else "fp32"
    return {"dtype": dtype, "loss_scale": args.get("loss_scale")}


def check_key_bias(checks: list, m, directory: str, notes: list) -> None:
    """Their key biases: dropped where softmax ignores them (learned positions, no
    --qk-layernorm), refused where they change the scores."""
    top = max((float(t.abs().max()) for _, t in checks), default=0.0)
    if top == 0.0:
        return
    if m.position_embedding_type == "rope" or m.qk_layernorm:
        why = "RoPE rotates it" if m.position_embedding_type == "rope" else \
            "--qk-layernorm normalizes it"
        raise CheckpointError(f"checkpoint {directory} holds non-zero key biases (max |b| "
                              f"{top:g}) in self_attention.linear_qkv.bias; this project's "
                              f"attention has none, and {why} into the scores: it cannot load "
                              "this checkpoint exactly")
    notes.append(f"checkpoint {directory}: the key biases (max |b| {top:g}) are left out: "
                 "softmax is invariant to them without RoPE")
