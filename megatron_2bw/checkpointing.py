"""Megatron-style checkpoints with exact resume.

Layout (Megatron's):
    {save}/latest_checkpointed_iteration.txt
    {save}/iter_0000100/mp_rank_00/model_optim_rng.pt          (one pipeline stage)
    {save}/iter_0000100/mp_rank_00_001/model_optim_rng.pt      (tensor rank 0, stage 1)

Each file holds the stage's engine state at an iteration boundary (newest fp32 weights, the 2BW
version the next batch runs on, optimizer, loss scaler), the iteration, the consumed samples, the
config and the parallel layout. Data-parallel replicas are identical, so replica 0 writes.

Writes are atomic: each file goes to a temporary name, is fsynced and renamed; after every rank has
written (a barrier), rank 0 writes `latest_checkpointed_iteration.txt` the same way. A writer
killed mid-save therefore never leaves a `latest` that points at a partial checkpoint.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import tempfile

import torch

from .config import Config, ConfigError

LATEST = "latest_checkpointed_iteration.txt"
FILENAME = "model_optim_rng.pt"


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used; the message names the file and the fix."""


def rank_dir(root: str, iteration: int, tp: int, pp: int, num_stages: int) -> str:
    name = f"mp_rank_{tp:02d}" if num_stages == 1 else f"mp_rank_{tp:02d}_{pp:03d}"
    return os.path.join(root, f"iter_{iteration:07d}", name)


def atomic_write(path: str, write) -> None:
    """write(file_object) into a temporary file next to `path`, fsync, then rename over it."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify_checksum(path: str) -> None:
    """Compare a checkpoint file with its `.sha256` sidecar; one-line error naming the file."""
    side = path + ".sha256"
    if not os.path.exists(side):
        raise CheckpointError(f"checkpoint file {path} has no checksum ({side} is missing): the "
                              "save did not finish; load an earlier iteration")
    want = open(side).read().split()[0]
    if sha256_of(path) != want:
        raise CheckpointError(f"checkpoint file {path} does not match its checksum: it is "
                              "truncated or corrupted; load an earlier iteration")


def prune(save_dir: str, keep_last: int) -> None:
    """Delete all but the `keep_last` newest iteration directories (never the latest)."""
    its = sorted(int(m.group(1)) for d in os.listdir(save_dir)
                 if (m := re.fullmatch(r"iter_(\d{7})", d)))
    latest = latest_iteration(save_dir)
    for it in its[:-keep_last] if keep_last > 0 else []:
        if it != latest:
            shutil.rmtree(os.path.join(save_dir, f"iter_{it:07d}"), ignore_errors=True)


def layout(cfg: Config, grid) -> dict:
    m = cfg.model
    return {"family": m.family, "num_layers": m.num_layers, "hidden_size": m.hidden_size,
            "num_attention_heads": m.num_attention_heads, "ffn_size": m.ffn_size,
            "vocab_size": m.vocab_size, "max_positions": m.max_positions,
            "tied": not m.untie_embeddings_and_output_weights,
            "tensor": grid.tensor, "pipeline": grid.pipeline}


def save_checkpoint(save_dir: str, engine, cfg: Config, grid, save_optim: bool = True,
                    keep_last: int = 0) -> str:
    """Collective over all ranks: every stage of replica 0 writes its file and its checksum,
    then rank 0 writes `latest` and prunes old iterations (keep_last > 0)."""
    t = engine.iteration
    path = os.path.join(rank_dir(save_dir, t, grid.tp_rank, grid.stage, grid.pipeline), FILENAME)
    if grid.dp_rank == 0:
        state = engine.state_dict()
        if not save_optim:
            state.pop("optimizer")
        payload = {"engine": state, "iteration": t,
                   "consumed_samples": t * cfg.batch.global_batch_size,
                   "layout": layout(cfg, grid), "config": cfg.to_dict(),
                   "rng": {"cpu": torch.get_rng_state()}}
        from .reliability import injected_fault
        if injected_fault("kill-in-save", grid, t):  # tests: die with a half-written file
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(os.path.join(os.path.dirname(path), ".tmp-partial"), "wb") as f:
                f.write(b"PK\x03\x04 half a checkpoint")
                f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        atomic_write(path, lambda f: torch.save(payload, f))
        digest = sha256_of(path)
        atomic_write(path + ".sha256", lambda f: f.write(f"{digest}  {FILENAME}\n".encode()))
    grid.comm.barrier()
    if grid.rank == 0:
        atomic_write(os.path.join(save_dir, LATEST), lambda f: f.write(f"{t}\n".encode()))
        if keep_last:
            prune(save_dir, keep_last)
    grid.comm.barrier()
    return path


def latest_iteration(load_dir: str) -> int | None:
    """The iteration named by `latest`, or None when the directory holds no checkpoint yet."""
    path = os.path.join(load_dir, LATEST)
    if not os.path.exists(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path} does not hold an iteration number ({text!r}): fix or "
                              "delete it")
    return int(text)


def _read(path: str, t: int, cfg: Config, grid) -> dict:
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint file {path} is missing: the checkpoint at iteration "
                              f"{t} is incomplete or was written with another parallel layout")
    verify_checksum(path)
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a damaged file
        raise CheckpointError(f"cannot read checkpoint file {path} ({type(e).__name__}): it is "
                              "truncated or corrupted; load an earlier iteration") from None
    theirs, ours = payload.get("layout", {}), layout(cfg, grid)
    diff = [f"{k} {theirs.get(k)} != {ours[k]}" for k in ours if theirs.get(k) != ours[k]]
    if diff:
        raise CheckpointError(f"checkpoint {path} was saved for another model or layout "
                              f"({', '.join(diff)}): use matching flags")
    return payload


def load_checkpoint(load_dir: str, engine, cfg: Config, grid, load_optim: bool = True,
                    finetune: bool = False) -> int:
    """Load this rank's stage state; returns the iteration to continue from (0 if none)."""
    t = latest_iteration(load_dir)
    if t is None:
        return 0
    path = os.path.join(rank_dir(load_dir, t, grid.tp_rank, grid.stage, grid.pipeline), FILENAME)
    payload, problem = None, None
    try:
        payload = _read(path, t, cfg, grid)
    except CheckpointError as e:
        problem = str(e)
    problems = grid.comm.gather_objects(problem)  # every rank reports the same first error
    first = next((p for p in problems if p), None)
    if first:
        raise CheckpointError(first)
    state = payload["engine"]
    if finetune or not load_optim or "optimizer" not in state:
        state = dict(state, optimizer=engine.stepper.optimizer.state_dict())
    if finetune:
        state = dict(state, iteration=0, skipped=0, scaler=engine.stepper.scaler.state_dict())
        state.pop("previous", None)
    try:
        engine.load_state_dict(state)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {path}: {e}") from None
    return engine.iteration
