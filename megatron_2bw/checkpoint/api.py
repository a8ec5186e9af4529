"""Checkpoints with exact resume, in three formats (`--ckpt-format`; loading detects the format,
Megatron-LM's own included: checkpoint/megatron/):

- torch_dist (the default; dist/ package): layout-free. Every tensor is saved under its global
  name and shape by the ranks that own it, so any (t, d, w), schedule and optimizer sharding
  loads it; --async-save writes it in the background.
- torch (Megatron's layout; torch_format.py, files.py): one file per stage and tensor rank holding
  the stage's engine state; loads only into the layout that saved it. Files of older versions of the
  model code load too (`legacy_layout`, `legacy_names`). With the distributed optimizer each
  data-parallel rank also writes its optimizer shard (`optimizer_shard_name`,
  optim/distributed.py's state) and the stage file records how many there are
  ("optimizer_shards"); a run with the same data-parallel size reads its own shard, any other
  run (another w, or no distributed optimizer) reads all of them and re-cuts them.
- megatron (checkpoint/megatron/export.py): torch_dist's boxes under megatron-core's names and
  layout, with Megatron-LM's common.pt: Megatron-LM's --load continues from it, and so does ours.
  Loading also reads what Megatron-LM writes (megatron-core torch_dist, Megatron's torch format
  with megatron-core or legacy names: checkpoint/megatron/dist_read.py, torch_read.py).

Both hold the engine state at an iteration boundary (newest fp32 weights, the 2BW version the
next batch runs on, optimizer, loss scaler, skipped steps), the iteration, the consumed samples,
the config, the layout and the RNG state.

A save is collective and all-or-nothing. Every rank first agrees that the iteration is newer
than `latest` and that every stage's weights are finite (else nobody writes); then the files are
written with their checksums (computed while writing) atomically; if any write failed (disk full
...), every rank raises the same one-line error and the files of that iteration are removed;
only when all succeeded does rank 0 move `latest` forward. A writer killed mid-save therefore
never leaves a `latest` that points at a partial checkpoint, and no save overwrites a newer
iteration.
"""
from __future__ import annotations

import os
import shutil

import torch

from megatron_2bw.checkpoint.files import (FILENAME, LATEST, CheckpointError, agree, agreed_latest,
                                           dangling_latest, iteration_dir, latest_iteration,
                                           not_newer, optimizer_shard_name, prune,
                                           publish_latest, rank_dir, remove_temporary_files,
                                           verify_once)
from megatron_2bw.checkpoint.layout import check_layout, common_parallel, layout, saved_layout
from megatron_2bw.config import Config, TrainConfig
from megatron_2bw.config.paths import check_writable_dir
from megatron_2bw.pipeline.faults import NO_FAULTS, FaultHooks, NumericsError

__all__ = ["LATEST", "FILENAME", "CheckpointError", "rank_dir", "latest_iteration",
           "save_checkpoint", "start_checkpoint", "load_checkpoint", "layout", "preflight",
           "remove_leftovers", "check_iterations", "resume_note"]


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
            return (f"the {key} weights of {grid.describe()} are not finite in {dtype} (max |w| "
                    f"{top:g}) at iteration {t}: no checkpoint written ({kept}); the run "
                    "diverged: lower --lr or add --clip-grad and resume from the last good one")
    return None


def common_state(engine, cfg: Config, grid) -> dict:
    """What every checkpoint records beside the tensors, at the engine's current iteration."""
    t = engine.iteration
    consumed = cfg.replace(parallel={"data": grid.data}).batch_plan.consumed(t)  # ramps too
    return {"iteration": t, "consumed_samples": consumed,
            "schedule": cfg.schedule, "scaler": engine.stepper.scaler.state_dict(),
            "skipped": engine.skipped_iterations, "layout": layout(cfg, grid),
            "parallel": common_parallel(cfg, grid), "config": cfg.to_dict()}


def _state_to_save(save_dir: str, engine, grid, everyone: bool) -> dict | None:
    """Collective: the engine state, after every rank agreed that the iteration is newer than
    `latest` and the weights are finite (else the same error everywhere, nothing written)."""
    t = engine.iteration
    current = latest_iteration(save_dir)
    if current is not None and t <= current:  # every rank reads the same `latest`
        raise CheckpointError(not_newer(save_dir, t, current))
    sharded = engine.weights.sharded  # a distributed optimizer: every replica saves its shard
    state = engine.state_dict() if (everyone or grid.dp_rank == 0 or sharded) else None
    bad = agree(_nonfinite(state, engine.weights.slots[0].dtype, grid, t, save_dir), grid)
    if bad:
        raise NumericsError(bad)
    return state


def start_checkpoint(save_dir: str, engine, cfg: Config, grid, view, save_optim: bool = True,
                     keep_last: int = 0, hooks: FaultHooks = NO_FAULTS,
                     asynchronous: bool = False, beside: dict[str, bytes] | None = None):
    """Collective: begin a torch_dist save of the current iteration (checkpoint/dist/save.py); the
    caller calls `.finish()` (collective) to publish it. `view`:
    ckpt.load.stage_boxes(engine, ...). `beside`: files (name -> bytes) published with it beside
    the iterations (the tokenizer: convert/tokenizers.tokenizer_files; files.publish_latest)."""
    from megatron_2bw.checkpoint.dist.save import start_save, tmp_dir
    if grid.rank == 0 and os.path.exists(tmp_dir(save_dir, engine.iteration)):
        shutil.rmtree(tmp_dir(save_dir, engine.iteration))  # a failed save of this iteration
    state = _state_to_save(save_dir, engine, grid, everyone=True)
    export = None
    if cfg.train.ckpt_format == "megatron":  # the same boxes under megatron-core's names
        from megatron_2bw.checkpoint.megatron.export import MegatronExport
        export = MegatronExport(cfg, grid.rank)
    return start_save(save_dir, engine, grid, view, common_state(engine, cfg, grid), save_optim,
                      keep_last, hooks, asynchronous, state=state, export=export, beside=beside)


def save_checkpoint(save_dir: str, engine, cfg: Config, grid, save_optim: bool = True,
                    keep_last: int = 0, hooks: FaultHooks = NO_FAULTS, view=None,
                    beside: dict[str, bytes] | None = None) -> str:
    """Collective, synchronous: save the current iteration in --ckpt-format, move `latest`
    forward (with `beside`: start_checkpoint) and prune old iterations (keep_last > 0); returns
    this rank's file or directory."""
    if cfg.train.ckpt_format in ("torch_dist", "megatron"):
        if view is None:
            from megatron_2bw.checkpoint.dist.load import stage_boxes
            view = stage_boxes(engine, cfg, grid)
        return start_checkpoint(save_dir, engine, cfg, grid, view, save_optim, keep_last,
                                hooks, beside=beside).finish()
    from megatron_2bw.checkpoint.torch_format import remove_stage_files, save_torch
    t = engine.iteration
    state = _state_to_save(save_dir, engine, grid, everyone=False)
    payload = dict(common_state(engine, cfg, grid), rng={"cpu": torch.get_rng_state()})
    current = latest_iteration(save_dir)
    kept = f"iteration {current}" if current is not None else "none"
    try:
        path = save_torch(save_dir, state, payload, grid, hooks, save_optim,
                          engine.weights.sharded)
    except CheckpointError as e:
        raise CheckpointError(f"{e}; the previous checkpoint ({kept}) in {save_dir} is intact"
                              ) from None
    problem = None
    if grid.rank == 0:
        try:
            publish_latest(save_dir, t, beside)
            if keep_last:
                prune(save_dir, keep_last)
        except CheckpointError as e:
            problem = str(e)
    problem = agree(problem, grid)
    if problem:
        if state is not None and latest_iteration(save_dir) != t:  # no half of an iteration
            remove_stage_files([path, os.path.join(os.path.dirname(path),
                                                   optimizer_shard_name(grid.dp_rank))])
        raise CheckpointError(problem)
    return path


def _read(path: str, t: int, cfg: Config, grid, engine, load_optim: bool) -> dict:
    """Collective: a torch-format stage file for this run's model and layout (one-line error
    otherwise), with the distributed optimizer's shards when `load_optim` and it holds them.
    Every file is hashed once in the job, by one of its readers, before it is unpickled
    (files.verify_once); every rank raises the same first problem."""
    from megatron_2bw.checkpoint.torch_format import read_torch, torch_file_problem
    verify_once([path], grid, lambda p: torch_file_problem(p, t))  # the replicas read one file
    problem, shards, own = None, [], False
    try:
        payload = read_torch(path, t, verify=False)
        check_layout(saved_layout(payload), cfg, grid, path, resharding=False)
        count = payload.get("optimizer_shards")
        if count and load_optim:  # its own shard when sharded over as many ranks, else all
            own = engine.weights.sharded and grid.data == count
            shards = [os.path.join(os.path.dirname(path), optimizer_shard_name(r))
                      for r in ([grid.dp_rank] if own else range(count))]
    except CheckpointError as e:
        problem = str(e)
    verify_once(shards, grid, lambda p: torch_file_problem(p, t), problem)
    if shards:
        states = [read_torch(p, t, verify=False)["optimizer"] for p in shards]
        payload["engine"]["optimizer"] = states[0] if own else states
    return payload


def _read_dist(directory: str, engine, cfg: Config, grid, load_optim: bool) -> dict:
    from megatron_2bw.checkpoint.dist.load import read_engine_state, stage_boxes
    return read_engine_state(
        directory, engine, stage_boxes(engine, cfg, grid), grid, cfg, load_optim,
        check_common=lambda common: check_layout(saved_layout(common), cfg, grid, directory,
                                                 resharding=True))


def _loss_scaling(precision: dict) -> tuple:
    """What a loss scaler's state means: (dtype, fixed scale or None for dynamic)."""
    dtype = precision.get("dtype", "fp32")
    return (dtype, precision.get("loss_scale") if dtype == "fp16" else 1.0)


def load_checkpoint(load_dir: str, engine, cfg: Config, grid, load_optim: bool = True,
                    finetune: bool = False, log=None, load_rng: bool = True) -> int:
    """Load this rank's stage state from the newest checkpoint in `load_dir`, in either format
    (a torch_dist one from any layout); returns the iteration to continue from (0 if none).
    A checkpoint saved with another precision or loss-scaling mode loads with a fresh loss
    scaler (log says so): fp16's scale means nothing to fp32/bf16 and vice versa. `load_rng`
    False (--no-load-rng): keep this process's RNG state instead of the checkpoint's."""
    from megatron_2bw.checkpoint.megatron.detect import detect
    from megatron_2bw.checkpoint.torch_format import stage_file
    t = agreed_latest(load_dir, grid)  # one reduction: every rank loads the same iteration
    if t is None:
        return 0
    directory = iteration_dir(load_dir, t)
    payload, problem, found = None, None, None
    try:
        found = detect(directory)  # the same files on every rank: the same verdict
    except CheckpointError as e:
        problem = str(e)
    dist = found is not None and found.format in ("torch_dist", "megatron")
    where = directory if dist or found is None or found.format == "deepspeed" else \
        stage_file(load_dir, t, grid)
    try:
        if found is not None:
            payload = _read_any(found, directory, where, t, engine, cfg, grid,
                                load_optim and not finetune)
    except CheckpointError as e:
        problem = str(e)
    first = agree(problem, grid)  # every rank reports the same first error
    if first:
        raise CheckpointError(first)
    for line in payload.get("notes", ()) if log is not None else ():
        log(line)
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
        raise CheckpointError(f"checkpoint {where}: {e}") from None
    if (dist or found.format == "deepspeed") and not finetune and load_rng:
        _restore_rng(payload, cfg, grid, engine.device, found.foreign)
    return engine.iteration


def _read_any(found, directory: str, where: str, t: int, engine, cfg: Config, grid,
              load_optim: bool) -> dict:
    """Collective: this rank's payload from a checkpoint of the format `found` names."""
    if found.format == "torch_dist":
        return _read_dist(directory, engine, cfg, grid, load_optim)
    if found.format == "torch":
        return _read(where, t, cfg, grid, engine, load_optim)
    from megatron_2bw.checkpoint.dist.load import stage_boxes
    if found.format == "deepspeed":
        from megatron_2bw.checkpoint.deepspeed_pipe.megatron_read import read_deepspeed
        return read_deepspeed(directory, engine, stage_boxes(engine, cfg, grid), grid, cfg,
                              load_optim)
    if found.format == "megatron":
        from megatron_2bw.checkpoint.megatron.dist_read import read_megatron_dist
        return read_megatron_dist(directory, engine, stage_boxes(engine, cfg, grid), grid, cfg,
                                  load_optim, found.verified)
    from megatron_2bw.checkpoint.megatron.torch_read import read_megatron_torch
    return read_megatron_torch(directory, engine, stage_boxes(engine, cfg, grid), grid, cfg,
                               load_optim)


def _restore_rng(payload: dict, cfg: Config, grid, device, foreign: bool = False) -> None:
    """This rank's RNG state, when the checkpoint was saved by the same layout (on another,
    the rank's coordinates mean another rank; dropout masks are a function of the seed, the
    stage and the microbatch anyway: engine._seed_microbatch). A Megatron checkpoint's reader
    gives the RNG state only when its (t, d) is this run's (Megatron's own rule)."""
    rng = payload.get("rng")
    saved = dict(payload["common"].get("parallel", {}))
    ours = common_parallel(cfg, grid)
    saved.pop("compensation", None), ours.pop("compensation")  # the RNG streams do not use it
    if rng is None or (saved != ours and not foreign):
        return
    torch.set_rng_state(rng["cpu"])
    if rng.get("cuda") is not None and torch.device(device).type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"], torch.device(device))


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
    run would overwrite it and move `latest` back). It writes nothing: a run that is refused
    later leaves --load and --save as they were (the leftovers of killed writers go once every
    rank has started: `remove_leftovers`; the tokenizer is recorded with the first save)."""
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
        dangling = dangling_latest(load, found) if found is not None else None
        if dangling:
            raise CheckpointError(f"--load: {dangling}")
        start = 0 if (found is None or train.finetune) else found
    if save:
        _check_save_dir(save)
        newer = latest_iteration(save)
        if newer is not None and newer > start:
            origin = f"iteration {start} of --load {load}" if load else "scratch (no --load)"
            raise CheckpointError(f"--save {save} already holds iteration {newer}, newer than "
                                  f"this run's start from {origin}: resume with --load {save}, "
                                  "or save this run elsewhere")
    check_iterations(train.train_iters, start, load)
    return start


def remove_leftovers(save: str, log=print) -> None:
    """Delete the temporary files that killed writers left in --save, saying so. Call it on one
    rank once every rank has started and before the first save (training/loop.py): no process of
    this job writes yet, and none was refused by its own checks."""
    for path in remove_temporary_files(save):
        log(f"removed {path}: the leftover of a checkpoint write that was killed")


def _check_save_dir(save: str) -> None:
    check_writable_dir(save, "--save", CheckpointError)


def check_iterations(train_iters: int, start: int, load: str | None) -> None:
    """A checkpoint past --train-iters is an error (the run would silently do nothing)."""
    if start > train_iters:
        raise CheckpointError(f"--train-iters {train_iters} is below iteration {start} of the "
                              f"checkpoint in --load {load}: raise --train-iters above {start}, "
                              "or load another checkpoint")
