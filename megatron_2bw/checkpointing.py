"""Megatron-style checkpoints with exact resume (files and their rules: checkpoint_files.py).

Each stage file holds the stage's engine state at an iteration boundary (newest fp32 weights, the
2BW version the next batch runs on, optimizer, loss scaler), the iteration, the consumed samples,
the config and the parallel layout. Data-parallel replicas are identical, so replica 0 writes.
With the distributed optimizer each data-parallel rank also writes its optimizer shard
(`optimizer_shard_name`, optim/distributed.py's state) and the stage file records how many there
are ("optimizer_shards"); a run with the same data-parallel size reads its own shard, any other
run (another w, or no distributed optimizer) reads all of them and re-cuts them.

A save is collective and all-or-nothing. Every rank first agrees that the iteration is newer
than `latest` and that every stage's weights are finite (else nobody writes); then each stage
writes its file and checksum atomically; if any write failed (disk full ...), every rank raises
the same one-line error and the files of that iteration are removed; only when all succeeded does
rank 0 move `latest` forward. A writer killed mid-save therefore never leaves a `latest` that
points at a partial checkpoint, and no save overwrites a newer iteration.
"""
from __future__ import annotations

import os

import torch

from .checkpoint_files import (FILENAME, LATEST, CheckpointError, latest_iteration, not_newer,
                               optimizer_shard_name, prune, rank_dir, remove_temporary_files,
                               verify_checksum, write_latest, write_with_checksum)
from .config import Config, TrainConfig
from .paths import check_writable_dir
from .reliability import NO_FAULTS, FaultHooks, NumericsError, describe

__all__ = ["LATEST", "FILENAME", "CheckpointError", "rank_dir", "latest_iteration",
           "save_checkpoint", "load_checkpoint", "layout", "preflight", "check_iterations"]


def layout(cfg: Config, grid) -> dict:
    m = cfg.model
    learned = m.position_embedding_type == "learned_absolute"
    return {"family": m.family, "num_layers": m.num_layers, "hidden_size": m.hidden_size,
            "num_attention_heads": m.num_attention_heads, "ffn_size": m.ffn_size,
            "vocab_size": m.vocab_size, "max_positions": m.max_positions if learned else None,
            "tied": not m.untie_embeddings_and_output_weights,
            "position_embedding_type": m.position_embedding_type,
            "normalization": m.normalization, "swiglu": m.swiglu,
            "query_groups": m.query_groups, "bias_linear": m.add_bias_linear,
            "tensor": grid.tensor, "pipeline": grid.pipeline}


def legacy_layout(saved: dict) -> dict:
    """A saved layout with the architecture keys that checkpoints written before them lack filled
    in as the only architecture they could hold (GPT-2 shaped)."""
    if not saved or "position_embedding_type" in saved:
        return saved
    return {"position_embedding_type": "learned_absolute", "normalization": "LayerNorm",
            "swiglu": False, "query_groups": saved.get("num_attention_heads"),
            "bias_linear": True, **saved}


def _agree(problem: str | None, grid) -> str | None:
    """Collective: the first rank's problem (in rank order), the same on every rank."""
    return next((p for p in grid.comm.gather_objects(problem) if p), None)


def _nonfinite(state: dict | None, dtype: torch.dtype, grid, t: int, save_dir: str
               ) -> str | None:
    """A message when the weights about to be saved are not finite as the engine computes with
    them (in `dtype`); one reduction per tensor, at save time only."""
    for key in ("newest", "previous"):
        tensor = state.get(key) if state else None
        if tensor is None:
            continue
        top = float(torch.linalg.vector_norm(tensor.detach(), float("inf")))  # max |w|, no copy
        if not (top <= torch.finfo(dtype).max):  # nan compares False
            last = latest_iteration(save_dir)
            kept = f"the last good one is iteration {last} in {save_dir}" if last is not None \
                else f"{save_dir} holds none"
            return (f"the {key} weights of {describe(grid)} are not finite in {dtype} (max |w| "
                    f"{top:g}) at iteration {t}: no checkpoint written ({kept}); the run "
                    "diverged: lower --lr or add --clip-grad and resume from the last good one")
    return None


def save_checkpoint(save_dir: str, engine, cfg: Config, grid, save_optim: bool = True,
                    keep_last: int = 0, hooks: FaultHooks = NO_FAULTS) -> str:
    """Collective over all ranks: every stage of replica 0 writes its file and its checksum,
    then rank 0 moves `latest` forward and prunes old iterations (keep_last > 0)."""
    t = engine.iteration
    path = os.path.join(rank_dir(save_dir, t, grid.tp_rank, grid.stage, grid.pipeline), FILENAME)
    current = latest_iteration(save_dir)
    if current is not None and t <= current:  # every rank reads the same `latest`
        raise CheckpointError(not_newer(save_dir, t, current))
    sharded = engine.weights.sharded
    state = engine.state_dict() if (grid.dp_rank == 0 or sharded) else None
    bad = _agree(_nonfinite(state, engine.weights.slots[0].dtype, grid, t, save_dir), grid)
    if bad:
        raise NumericsError(bad)
    problem, written = None, []
    if state is not None:
        writes = _files_to_write(path, state, t, cfg, grid, save_optim, sharded)
        hooks.during_save(grid, t, path)
        try:
            for target, payload in writes:
                written.append(target)
                write_with_checksum(target, lambda f, payload=payload: torch.save(payload, f))
        except CheckpointError as e:
            kept = f"iteration {current}" if current is not None else "none"
            problem = f"{e}; the previous checkpoint ({kept}) in {save_dir} is intact"
    problem = _agree(problem, grid)
    if problem is None and grid.rank == 0:
        try:
            write_latest(save_dir, t)
            if keep_last:
                prune(save_dir, keep_last)
        except CheckpointError as e:
            problem = str(e)
    problem = _agree(problem, grid)
    if problem:
        if written and latest_iteration(save_dir) != t:
            _remove_stage_files(written)  # leave no half of an iteration behind
        raise CheckpointError(problem)
    return path


def _files_to_write(path: str, state: dict, t: int, cfg: Config, grid, save_optim: bool,
                    sharded: bool) -> list[tuple[str, dict]]:
    """(file, payload) this rank writes: replica 0 the stage file, and with the distributed
    optimizer every data-parallel rank its optimizer shard."""
    optimizer = state.pop("optimizer")
    out = []
    if grid.dp_rank == 0:
        engine_state = dict(state, optimizer=optimizer) if (save_optim and not sharded) \
            else state
        payload = {"engine": engine_state, "iteration": t,
                   "consumed_samples": t * cfg.batch.global_batch_size,
                   "layout": layout(cfg, grid), "config": cfg.to_dict(),
                   "rng": {"cpu": torch.get_rng_state()}}
        if sharded and save_optim:
            payload["optimizer_shards"] = grid.data
        out.append((path, payload))
    if sharded and save_optim:
        shard = os.path.join(os.path.dirname(path), optimizer_shard_name(grid.dp_rank))
        out.append((shard, {"optimizer": optimizer, "iteration": t,
                            "layout": layout(cfg, grid)}))
    return out


def _remove_stage_files(paths: list[str]) -> None:
    for path in paths:
        for p in (path, path + ".sha256"):
            if os.path.exists(p):
                os.unlink(p)
    path = paths[0]
    for d in (os.path.dirname(path), os.path.dirname(os.path.dirname(path))):
        try:
            os.rmdir(d)  # only when empty: other stages may still be removing theirs
        except OSError:
            pass


def _read(path: str, t: int, cfg: Config, grid) -> dict:
    payload = _load_file(path, t)
    theirs, ours = legacy_layout(payload.get("layout", {})), layout(cfg, grid)
    diff = [f"{k} {theirs.get(k)} != {ours[k]}" for k in ours if theirs.get(k) != ours[k]]
    if diff:
        raise CheckpointError(f"checkpoint {path} was saved for another model or layout "
                              f"({', '.join(diff)}): use matching flags")
    return payload


def _load_file(path: str, t: int) -> dict:
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint file {path} is missing: the checkpoint at iteration "
                              f"{t} is incomplete or was written with another parallel layout")
    verify_checksum(path)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a damaged file
        raise CheckpointError(f"cannot read checkpoint file {path} ({type(e).__name__}): it is "
                              "truncated or corrupted; load an earlier iteration") from None
    return payload


def _optimizer_shards(path: str, t: int, count: int, engine, grid):
    """The distributed-optimizer state saved by `count` data-parallel ranks, as this engine
    loads it: its own shard when it runs sharded over as many ranks, else all of them."""
    directory = os.path.dirname(path)
    own = engine.weights.sharded and grid.data == count
    ranks = [grid.dp_rank] if own else range(count)
    shards = [_load_file(os.path.join(directory, optimizer_shard_name(r)), t)["optimizer"]
              for r in ranks]
    return shards[0] if own else shards


def _loss_scaling(precision: dict) -> tuple:
    """What a loss scaler's state means: (dtype, fixed scale or None for dynamic)."""
    dtype = precision.get("dtype", "fp32")
    return (dtype, precision.get("loss_scale") if dtype == "fp16" else 1.0)


def load_checkpoint(load_dir: str, engine, cfg: Config, grid, load_optim: bool = True,
                    finetune: bool = False, log=None) -> int:
    """Load this rank's stage state; returns the iteration to continue from (0 if none).
    A checkpoint saved with another precision or loss-scaling mode loads with a fresh loss
    scaler (log says so): fp16's scale means nothing to fp32/bf16 and vice versa."""
    t = latest_iteration(load_dir)
    if t is None:
        return 0
    path = os.path.join(rank_dir(load_dir, t, grid.tp_rank, grid.stage, grid.pipeline), FILENAME)
    payload, problem = None, None
    try:
        payload = _read(path, t, cfg, grid)
        shards = payload.get("optimizer_shards")
        if shards and load_optim and not finetune:
            payload["engine"]["optimizer"] = _optimizer_shards(path, t, shards, engine, grid)
    except CheckpointError as e:
        problem = str(e)
    first = _agree(problem, grid)  # every rank reports the same first error
    if first:
        raise CheckpointError(first)
    state = payload["engine"]
    if finetune or not load_optim:
        state = {k: v for k, v in state.items() if k != "optimizer"}  # the optimizer starts fresh
    theirs = _loss_scaling(payload.get("config", {}).get("precision", {}))
    ours = _loss_scaling({"dtype": cfg.precision.dtype, "loss_scale": cfg.precision.loss_scale})
    if finetune or theirs != ours:
        state = dict(state, scaler=engine.stepper.scaler.state_dict())
        if theirs != ours and log is not None:
            log(f"checkpoint {load_dir} (iteration {t}) was saved with {_scaling_name(theirs)}; "
                f"continuing with {_scaling_name(ours)}: the loss scaler starts fresh")
    if finetune:
        state = dict(state, iteration=0, skipped=0)
        state.pop("previous", None)
    try:
        engine.load_state_dict(state)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path}: {e}") from None
    return engine.iteration


def _scaling_name(scaling: tuple) -> str:
    dtype, scale = scaling
    if dtype != "fp16":
        return dtype
    return "fp16 (dynamic loss scale)" if scale is None else f"fp16 (loss scale {scale:g})"


# -- start-up checks (before any process group) ---------------------------------------------------
def preflight(train: TrainConfig, rank: int = 0, log=print) -> int:
    """Check --load and --save before training starts; returns the iteration the run starts from.

    --load must hold a checkpoint, unless it equals --save (the first start of a job that is
    resubmitted with the same flags: announced in one line). --save must be a directory this
    process can create and write, and must not hold an iteration newer than the start (a fresh
    run would overwrite it and move `latest` back). Rank 0 deletes the temporary files that killed
    writers left in --save (no process of this job writes yet)."""
    load, save = train.load, train.save
    same = bool(load and save) and os.path.realpath(load) == os.path.realpath(save)
    start = 0
    if load and os.path.exists(load) and not os.path.isdir(load):
        raise CheckpointError(f"--load {load} is a file, not a checkpoint directory: fix the path")
    if load:
        found = latest_iteration(load) if os.path.isdir(load) else None
        if found is None and not same:
            what = "does not exist" if not os.path.exists(load) else f"holds no checkpoint " \
                f"(no {LATEST})"
            raise CheckpointError(f"--load {load} {what}: fix the path, or pass the same "
                                  "directory to --load and --save to start a new job")
        if found is None and rank == 0:
            log(f"--load {load} holds no checkpoint yet and equals --save: starting from scratch "
                "(the first start of this job)")
        start = 0 if (found is None or train.finetune) else found
    if save:
        _check_save_dir(save)
        if rank == 0:
            for path in remove_temporary_files(save):
                log(f"removed {path}: the leftover of a checkpoint write that was killed")
        newer = latest_iteration(save)
        if newer is not None and newer > start:
            origin = f"iteration {start} of --load {load}" if load else "scratch (no --load)"
            raise CheckpointError(f"--save {save} already holds iteration {newer}, newer than "
                                  f"this run's start from {origin}: resume with --load {save}, "
                                  "or save this run elsewhere")
    check_iterations(train.train_iters, start, load)
    return start


def _check_save_dir(save: str) -> None:
    check_writable_dir(save, "--save", CheckpointError)


def check_iterations(train_iters: int, start: int, load: str | None) -> None:
    """A checkpoint past --train-iters is an error (the run would silently do nothing)."""
    if start > train_iters:
        raise CheckpointError(f"--train-iters {train_iters} is below iteration {start} of the "
                              f"checkpoint in --load {load}: raise --train-iters above {start}, "
                              "or load another checkpoint")
