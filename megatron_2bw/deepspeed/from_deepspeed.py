"""`engine.load_checkpoint` of a tag written by DeepSpeed itself (its PipelineEngine, e.g. a
Megatron-DeepSpeed run) for the same PipelineModule: checkpoint.py reads the layer files by
layer index (the tied layers' copies included); this module adds what DeepSpeed's
`_load_checkpoint` restores beside them, as it restores it (deepspeed/runtime/engine.py):

- global_steps, global_samples and skipped_steps from this stage's mp_rank_XX_model_states.pt;
- the optimizer state (ZeRO-0's torch state, ZeRO-1's partitions of every data-parallel rank:
  checkpoint/deepspeed_pipe/zero.py) by parameter name onto the flat optimizer: our
  PipelineModule names its parameters as DeepSpeed's does (`tied_modules.<key>.<path>` first,
  then `<layer index>.<path>`); with ZeRO's fp32 master weights (bf16 / fp16 runs) the newest
  weights are those, not the 16-bit layer files. A state that cannot be mapped restarts, said
  in one line (rank 0);
- the lr scheduler: this engine's lr is the config's "scheduler" at the loaded step (skipped
  steps do not advance it, as DeepSpeed's); a saved state that is no such scheduler's (a
  client object, such as Megatron's OptimizerParamScheduler) is said in one line;
- client_state: every key DeepSpeed does not restore itself (`_load_checkpoint`'s rule, with
  ZeRO-0's optimizer state under "optimizer" as DeepSpeed returns it).
The 2BW previous version is not in DeepSpeed's files: the first batch runs on the loaded weights.
"""
from __future__ import annotations

import os

import torch

from megatron_2bw.checkpoint.deepspeed_pipe import files as ds_files
from megatron_2bw.checkpoint.deepspeed_pipe.zero import stage_optimizer
from megatron_2bw.checkpoint.files import CheckpointError

_OURS = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq", "momentum": "momentum_buffer"}


def returned_client_state(record: dict, load_optimizer: bool, load_lr: bool,
                          module_only: bool, zero_engine: bool) -> dict:
    """What DeepSpeed's load_checkpoint returns as client_state from a state file."""
    restored = ["module"] if module_only else [
        "module", "skipped_steps", "global_steps", "dp_world_size", "mp_world_size",
        "data_sampler", "random_ltd"]
    restored += (["lr_scheduler"] if load_lr else []) + (["optimizer"] if load_optimizer else [])
    out = {k: v for k, v in record.items() if k not in restored}
    if load_optimizer and not module_only and not zero_engine and record.get("optimizer"):
        out["optimizer"] = record["optimizer"]
    return out


def _engine_index(module, index: dict[str, int]) -> dict[str, int]:
    """DeepSpeed's parameter names of this stage -> positions in the engine's flat layout."""
    out = {}
    tied_at = {}
    for idx, entry in module._entries.items():
        if entry[0] == "tied":
            tied_at.setdefault(entry[1], []).append(idx)
    for name, _ in module.named_parameters():
        head, _, rest = name.partition(".")
        if head == "tied_modules":
            key, _, rest = rest.partition(".")
            candidates = [f"layers.{i}.layer.{rest}" for i in tied_at.get(key, ())]
        else:
            candidates = [f"layers.{head}.layer.{rest}"]
        found = next((index[c] for c in candidates if c in index), None)
        if found is not None:
            out[name] = found
    return out


def load_deepspeed_state(path: str, adapter, state: dict, record: dict, load_optimizer: bool,
                         load_lr: bool) -> dict:
    """The engine state (its weights already from the layer files) with what DeepSpeed restores
    from this stage's `record` and ZeRO files; notes go to rank 0's stdout."""
    state = dict(state, iteration=int(record.get("global_steps", state["iteration"])),
                 skipped=int(record.get("skipped_steps", 0)))
    state.pop("previous", None)
    notes = []
    if load_optimizer:
        why = _load_optimizer(path, adapter, state, record)
        if why:
            notes.append(f"{path}: optimizer state restarts: {why}")
    saved = record.get("lr_scheduler")
    if load_lr and isinstance(saved, dict) and set(saved) - {"last_batch_iteration"}:
        notes.append(f"{path}: its lr_scheduler state ({', '.join(sorted(saved)[:3])} ...) is a "
                     "client scheduler's, which this engine does not take: the lr follows the "
                     f"config's \"scheduler\" from global step {state['iteration']}")
    if adapter.global_rank == 0:
        for line in notes:
            print(f"warning: {line}", flush=True)
    return state


def _saved_optimizer(path: str, adapter, record: dict):
    """(the saved optimizer state by DeepSpeed's parameter names, None) or (None, why). ZeRO's
    names its parameters, so every stage's files are read (any stage count loads them; a name
    that several stages hold, a tied module's, from this stage's own file, else the first);
    ZeRO-0's is cut by this stage module's order, so only the layout that saved it reads it."""
    files = ds_files.tag_files(path)
    t = max(1, files.tensor)
    tp = adapter.grid.get_slice_parallel_rank()
    if not files.zero:
        saved = len(files.states) // t
        if saved != adapter.num_stages:
            return None, (f"ZeRO-0 keeps it by position in each stage module, which was cut "
                          f"into {saved} stages; this run has {adapter.num_stages}: load it "
                          "with the stage count that saved it")
        module = adapter.module
        params = [(n, tuple(p.shape)) for n, p in module.named_parameters()]
        return stage_optimizer(record, [], params)
    merged, own = None, adapter.stage_id * t + tp
    for mp in sorted(files.zero, key=lambda mp: (mp != own, mp)):  # this stage's own first
        if mp % t != tp:
            continue
        zero = [ds_files.read_file(files.zero[mp][d])["optimizer_state_dict"]
                for d in sorted(files.zero[mp])]
        mine = record if mp == own else \
            ds_files.read_file(files.states[mp]) if mp in files.states else {}
        got, why = stage_optimizer(mine, zero, None)
        if got is None:
            return None, why
        if merged is None:
            merged = got
        else:
            for name, value in got.tensors.items():
                merged.tensors.setdefault(name, value)
    return merged, None


def _load_optimizer(path: str, adapter, state: dict, record: dict) -> str | None:
    """Fill state["optimizer"] (the unsharded flat form) and, with ZeRO's fp32 master,
    state["newest"]; the reason when the saved state cannot be mapped (parameters of this
    stage that it holds no state of are named in a warning: theirs start at zero)."""
    got, why = _saved_optimizer(path, adapter, record)
    if got is None:
        return why
    module = adapter.module
    w = adapter._engine.weights
    where = _engine_index(module, {n: i for i, n in enumerate(w.names)})
    theirs = state["optimizer"]
    keys = sorted({k for piece in theirs.get("pieces", ()) for k in piece
                   if k not in ("range", "master")} or
                  {k for k, v in theirs.items() if torch.is_tensor(v) and v.dim() == 1})
    missing = [k for k in keys if k not in _OURS]
    if missing:
        return f"this engine's optimizer keeps {missing[0]}, which DeepSpeed's does not"
    numel = state["newest"].numel()
    flat = {k: torch.zeros(numel, dtype=torch.float32) for k in keys}
    for name, i in where.items():
        saved = got.tensors.get(name)
        if saved is None:
            continue
        lo, n = w.offsets[i], w.shapes[i].numel()
        for key in keys:
            value = saved.get(_OURS[key])
            if value is not None:
                flat[key][lo:lo + n] = value.float()
        if "fp32" in saved and w.master is not None:
            state["newest"][lo:lo + n] = saved["fp32"].float()
    unmapped = sorted(set(where) - set(got.tensors))
    if len(unmapped) == len(where):
        return "none of its saved states names a parameter of this PipelineModule"
    if unmapped and adapter.grid.get_data_parallel_rank() == 0:
        print(f"warning: {path}: no saved optimizer state of {len(unmapped)} parameters of "
              f"stage {adapter.stage_id} ({', '.join(unmapped[:3])}): theirs start at zero",
              flush=True)
    state["optimizer"] = dict(flat, steps=int(got.steps or state["iteration"]))
    return None


def read_foreign(file: str) -> dict:
    """A file of a tag without our checksums: DeepSpeed's own (its objects through the
    allow-list unpickler; zip's CRC-32 of the pickled record checked first)."""
    if not os.path.exists(file):
        raise CheckpointError(f"checkpoint file {file} is missing: the checkpoint is "
                              "incomplete; load an earlier iteration")
    return ds_files.read_file(file)
