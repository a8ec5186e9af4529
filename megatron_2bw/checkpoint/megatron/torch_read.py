"""Reading Megatron's `--ckpt-format torch` checkpoints into an engine of any layout:

    iter_0000100/mp_rank_TT/model_optim_rng.pt          tensor rank TT (one pipeline stage)
    iter_0000100/mp_rank_TT_PPP/model_optim_rng.pt      tensor rank TT of pipeline stage PPP

each holding {"args", "checkpoint_version", "iteration", "model", "optimizer",
"opt_param_scheduler", "rng_state", ...} (megatron/training/checkpointing.py). "model" is the
stage's state dict: megatron-core module names (`decoder.layers.0.self_attention.linear_qkv.
weight`, local or transformer-engine spec) or the legacy nested dicts (`language_model` ->
`embedding` / `encoder` -> `layers.0.self_attention.query_key_value.weight`), with the stage's
layers numbered from 0 (a stage's offset is the layers of the stages before it).

Tensors that are no parameter of this model are said in one line ("left out").
The format forces a whole-model read: every rank reads every file into memory (nothing is
written, --load stays as it is), joins the tensor ranks' shards (mapping.merge_tp: SwiGLU's fc1 per
rank is [gate_r; up_r]) and cuts its own boxes through mapping.pieces. Its optimizer state is
keyed by Megatron's parameter order (ids per param group), which is Megatron's build order, not
its names: it restarts, said in one line (an fp16 run's dynamic loss scale, its grad_scaler,
carries over). The RNG state comes back where (t, d) matches.
"""
from __future__ import annotations

import os
import re
from collections import defaultdict

import torch

from megatron_2bw.checkpoint.dist.shards import MODEL, empty_state, state_shards
from megatron_2bw.checkpoint.files import CheckpointError
from megatron_2bw.checkpoint.megatron import mapping
from megatron_2bw.checkpoint.megatron.common import (args_of, check_model, consumed_samples,
                                                     loss_scaler_state)
from megatron_2bw.checkpoint.megatron.detect import stage_files
from megatron_2bw.checkpoint.megatron.dist_read import NOT_VERIFIED, check_key_bias, precision_of

_RANKS = re.compile(r"mp_rank_(\d+)(?:_(\d+))?$")


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _read(path: str) -> dict:
    from megatron_2bw.checkpoint.megatron.pickles import load_megatron_file
    try:
        state = load_megatron_file(path)
    except Exception as e:  # noqa: BLE001 - a damaged file fails in many ways
        raise CheckpointError(f"cannot read checkpoint file {path} ({type(e).__name__}): it is "
                              "truncated or corrupted; load an earlier iteration") from None
    if "model" not in state:
        more = " (a virtual pipeline: model0, model1 ...)" if "model0" in state else ""
        raise CheckpointError(f"checkpoint file {path} holds no 'model'{more}: this project "
                              "reads Megatron's torch format without a virtual pipeline")
    return state


def logical_state(model: dict, family: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """A stage file's tensors by logical name (its layers numbered from 0, as the stage holds
    them), and its tensors that name no parameter (the tied head copy and extra state aside)."""
    flat = flatten(model)
    legacy = any(k.startswith("language_model.") for k in flat)
    out, unknown = {}, []
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor) or key.endswith("_extra_state"):
            continue
        name = mapping.from_legacy(key, family) if legacy else mapping.from_module_name(key)
        if name is None:
            if key != mapping.TIED_HEAD_COPY:
                unknown.append(key)
            continue
        out[name] = value
    return out, unknown


def full_tensors(directory: str, m) -> tuple[dict[str, torch.Tensor], dict]:
    """Every logical tensor whole (global layer numbers), and the first stage file's other
    state (args, iteration, rng ...), from all of a torch-format iteration directory."""
    files = stage_files(directory)
    by_rank, first, rngs, unnamed = {}, None, {}, set()
    for path in files:
        match = _RANKS.match(os.path.basename(os.path.dirname(path)))
        if match is None:
            continue
        state = _read(path)
        tp, pp = int(match.group(1)), int(match.group(2) or 0)
        by_rank[pp, tp], unknown = logical_state(state["model"], m.family)
        unnamed.update(unknown)
        rngs[pp, tp] = state.get("rng_state")
        if (pp, tp) == (0, 0):
            first = {k: v for k, v in state.items() if k != "model"}
    stages = 1 + max(pp for pp, _ in by_rank)
    tensors = 1 + max(tp for _, tp in by_rank)
    missing = [(pp, tp) for pp in range(stages) for tp in range(tensors) if (pp, tp) not in by_rank]
    if missing or first is None:
        pp, tp = missing[0] if missing else (0, 0)
        raise CheckpointError(f"checkpoint {directory} lacks the file of tensor rank {tp} of "
                              f"stage {pp}: the checkpoint is incomplete")
    offsets, offset = [], 0
    for pp in range(stages):
        offsets.append(offset)
        local = {mapping.layer_of(n)[1] for n in by_rank[pp, 0] if mapping.layer_of(n)}
        offset += len(local)
    shards = defaultdict(dict)
    for (pp, tp), named in by_rank.items():
        for name, value in named.items():
            parts = mapping.layer_of(name)
            if parts:
                block, i, rest = parts
                name = f"{block}.layers.{i + offsets[pp]}.{rest}"
            shards[name].setdefault(tp, value)  # a stage's tied copy of a name held elsewhere
    first["rng_states"], first["unnamed"] = rngs, sorted(unnamed)
    return {name: mapping.merge_tp(name, [by_tp[r] for r in sorted(by_tp)], m.swiglu)
            for name, by_tp in shards.items()}, first


def read_megatron_torch(directory: str, engine, view, grid, cfg, load_optim: bool) -> dict:
    """This rank's engine state from Megatron's torch format in `directory` (no collective),
    shaped like dist_read.read_megatron_dist's payload."""
    m = cfg.model
    notes = [f"checkpoint {directory}: {NOT_VERIFIED}"]
    full, state = full_tensors(directory, m)
    args = args_of(state)
    check_model(args, m, directory)
    if not args:
        notes.append(f"checkpoint {directory} records no Megatron args: only its tensors' "
                     "names and shapes are checked against this model")
    if load_optim:
        notes.append("optimizer state restarts: " + (
            "Megatron's torch format keys it by parameter position in its own build order, "
            "not by name; save it with --ckpt-format torch_dist in Megatron to carry Adam's "
            "moments over" if state.get("optimizer") else "the checkpoint holds none"))
    buffers = empty_state(view.numel, None, {})
    ours, _ = state_shards(buffers, view.params, view.numel, reading=True)
    by_name, checks = {x.ours: x for x in mapping.links(m)}, []
    for s in ours:
        link = by_name[s.name[len(MODEL):]]
        theirs = full.get(link.theirs)
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
        for o, n in mapping.key_pieces(link, s.offsets, tuple(s.tensor.shape)):
            checks.append((link, mapping.box(theirs, o, n)))
    check_key_bias(checks, m, directory, notes)
    read = {x.theirs for x in by_name.values()}
    head, table = full.get("output_layer.weight"), full.get("embedding.word_embeddings.weight")
    if head is not None and table is not None and head.shape == table.shape and \
            torch.equal(head, table):
        read.add("output_layer.weight")  # a last stage's copy of the tied embedding
    left = state["unnamed"] + sorted(set(full) - read)
    if left:
        notes.append(f"checkpoint {directory}: left out (no parameter of this model): "
                     f"{', '.join(left)}")
    it = int(state.get("iteration", 0))
    scaler = (loss_scaler_state(state) if load_optim else None) or \
        engine.stepper.scaler.state_dict()  # fp16's dynamic loss scale: Megatron's optimizer's
    engine_state = {"iteration": it, "schedule": cfg.schedule, "names": list(engine.weights.names),
                    "newest": buffers["newest"], "scaler": scaler, "skipped": 0}
    from megatron_2bw.checkpoint.megatron.common import parallel_of
    return {"engine": engine_state, "iteration": it,
            "consumed_samples": consumed_samples(state, it),
            "config": {"precision": precision_of(args)}, "notes": notes,
            "rng": _rng(state["rng_states"], args, grid),
            "common": {"parallel": parallel_of(args)},
            "state": state}


def _rng(rngs: dict, args: dict, grid) -> dict | None:
    """This rank's RNG state from its own stage file's, where (t, d) is the checkpoint's."""
    t, d = args.get("tensor_model_parallel_size"), args.get("pipeline_model_parallel_size")
    if (t, d) != (grid.tensor, grid.pipeline):
        return None
    rng = rngs.get((grid.stage, grid.tp_rank))
    if isinstance(rng, (list, tuple)):
        rng = rng[grid.dp_rank] if len(rng) > grid.dp_rank else (rng[0] if rng else None)
    if not isinstance(rng, dict) or "torch_rng_state" not in rng:
        return None
    return {"cpu": rng["torch_rng_state"], "cuda": rng.get("cuda_rng_state")}
