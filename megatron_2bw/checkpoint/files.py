"""The files of a checkpoint directory and the rules that keep them whole:

    {dir}/latest_checkpointed_iteration.txt             the newest complete iteration
    --ckpt-format torch (Megatron's layout, one file per stage and tensor rank):
    {dir}/iter_0000100/mp_rank_00/model_optim_rng.pt    one stage's state (+ .sha256 beside it)
    {dir}/iter_0000100/mp_rank_00_001/...               tensor rank 0, stage 1 (d > 1)
    {dir}/iter_0000100/mp_rank_00/distrib_optim_dp002.pt  data-parallel rank 2's optimizer shard
                                                        (--use-distributed-optimizer; the
                                                        stage file then holds no optimizer)
    --ckpt-format torch_dist (layout-free, dist/ package):
    {dir}/iter_0000100/.metadata, __<rank>_0.distcp     DCP's files
    {dir}/iter_0000100/checksums.sha256                 the sha256 of each, computed while writing
    {dir}/.tmp-iter_0000100/                            a torch_dist save in progress, renamed to
                                                        iter_0000100 once every rank's files are
                                                        durable
    {dir}/.../.tmp-XXXXXX                               a write in progress (TMP_PREFIX)

- Every file is written to a `.tmp-` name next to it, fsynced and renamed over the target (fs.py),
  so a reader sees the old file or the new one, never half of one. A writer killed mid-write leaves
  only a `.tmp-` file, which `remove_temporary_files` deletes at the next start.
- A failed write (disk full, quota, permissions) is one CheckpointError naming the file, the
  bytes written and the OS error (torch.save would report "unexpected pos" instead).
- `latest` names an iteration only after every stage's file of it is complete.
"""
from __future__ import annotations

import glob
import hashlib
import os
import re
import shutil

from megatron_2bw import fs
from megatron_2bw.config import ConfigError

LATEST = "latest_checkpointed_iteration.txt"
FILENAME = "model_optim_rng.pt"


def optimizer_shard_name(dp_rank: int) -> str:
    """The file of a data-parallel rank's distributed-optimizer shard, next to FILENAME."""
    return f"distrib_optim_dp{dp_rank:03d}.pt"


TMP_PREFIX = fs.TMP_PREFIX


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used or written; the message names the file and the fix."""


def agree(problem: str | None, grid) -> str | None:
    """Collective: the first rank's problem (in rank order), the same on every rank."""
    return next((p for p in grid.comm.gather_objects(problem) if p), None)


def iteration_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def rank_dir(root: str, iteration: int, tp: int, pp: int, num_stages: int) -> str:
    name = f"mp_rank_{tp:02d}" if num_stages == 1 else f"mp_rank_{tp:02d}_{pp:03d}"
    return os.path.join(iteration_dir(root, iteration), name)


def write_checkpoint_file(path: str, write) -> str:
    """fs.atomic_write (write(file) to a temporary sibling, fsync, rename; returns the sha256),
    with a failed write as one CheckpointError naming the file, the bytes written and the fix;
    `path` is left as it was."""
    try:
        return fs.atomic_write(path, write)
    except fs.WriteError as e:
        raise CheckpointError(write_error(path, e.cause, e.written)) from None


def write_error(path: str, e: OSError, written: int) -> str:
    return fs.write_problem(f"checkpoint file {path}", e, written, where="--save")


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_with_checksum(path: str, write) -> None:
    """write_checkpoint_file(path, write) and then its `.sha256` sidecar (hashed while writing)."""
    digest = write_checkpoint_file(path, write)
    write_checkpoint_file(path + ".sha256",
                          lambda f: f.write(f"{digest}  {os.path.basename(path)}\n".encode()))


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


def read_checkpoint_file(path: str, weights_only: bool = True, verify: bool = True):
    """torch.load of a checkpoint file onto the CPU, after verify_checksum when `verify`; a file
    that does not unpickle is one CheckpointError naming it."""
    import torch
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint file {path} is missing: the checkpoint is "
                              "incomplete; load an earlier iteration")
    if verify:
        verify_checksum(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a damaged file
        raise CheckpointError(f"cannot read checkpoint file {path} ({type(e).__name__}): it is "
                              "truncated or corrupted; load an earlier iteration") from None


def latest_iteration(directory: str) -> int | None:
    """The iteration named by `latest`, or None when the directory holds no checkpoint yet."""
    path = os.path.join(directory, LATEST)
    if not os.path.exists(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path} does not hold an iteration number ({text!r}): fix or "
                              "delete it")
    return int(text)


def write_latest(directory: str, iteration: int) -> None:
    """Point `latest` at `iteration`; it only ever moves forward."""
    current = latest_iteration(directory)
    if current is not None and iteration <= current:
        raise CheckpointError(not_newer(directory, iteration, current))
    write_checkpoint_file(os.path.join(directory, LATEST),
                          lambda f: f.write(f"{iteration}\n".encode()))


def not_newer(directory: str, iteration: int, current: int) -> str:
    return (f"refusing to save iteration {iteration} into {directory}: it already holds the newer "
            f"iteration {current} (latest); resume from it with --load {directory}, or save "
            "this run elsewhere")


def iterations(directory: str) -> list[int]:
    return sorted(int(m.group(1)) for d in os.listdir(directory)
                  if (m := re.fullmatch(r"iter_(\d{7})", d)))


def prune(save_dir: str, keep_last: int) -> None:
    """Delete all but the `keep_last` newest iteration directories (never the latest)."""
    latest = latest_iteration(save_dir)
    for it in iterations(save_dir)[:-keep_last] if keep_last > 0 else []:
        if it != latest:
            shutil.rmtree(iteration_dir(save_dir, it), ignore_errors=True)


def temporary_files(directory: str) -> list[str]:
    """Leftover `.tmp-` files and torch_dist save directories of interrupted writes in a
    checkpoint tree (only where this package writes: the top level and the iter_*/mp_rank_*
    directories)."""
    return sorted(glob.glob(os.path.join(directory, TMP_PREFIX + "*")) +
                  glob.glob(os.path.join(directory, "iter_*", "mp_rank_*", TMP_PREFIX + "*")))


def remove_temporary_files(directory: str) -> list[str]:
    """Delete the leftovers of writes that a killed process never finished; returns them.
    Call it only when no process of this job writes into `directory`."""
    removed = []
    for path in temporary_files(directory):
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed
