"""The files of a checkpoint directory (Megatron's layout) and the rules that keep them whole:

    {dir}/latest_checkpointed_iteration.txt             the newest complete iteration
    {dir}/iter_0000100/mp_rank_00/model_optim_rng.pt    one stage's state (+ .sha256 beside it)
    {dir}/iter_0000100/mp_rank_00_001/...               tensor rank 0, stage 1 (d > 1)
    {dir}/iter_0000100/mp_rank_00/distrib_optim_dp002.pt  data-parallel rank 2's optimizer shard
                                                        (--use-distributed-optimizer; the
                                                        stage file then holds no optimizer)
    {dir}/.../.tmp-XXXXXX                               a write in progress (TMP_PREFIX)

- Every file is written to a `.tmp-` name next to it, fsynced and renamed over the target, so a
  reader sees the old file or the new one, never half of one. A writer killed mid-write leaves
  only a `.tmp-` file, which `remove_temporary_files` deletes at the next start.
- A failed write (disk full, quota, permissions) is one CheckpointError naming the file, the
  bytes written and the OS error (torch.save would report "unexpected pos" instead).
- `latest` names an iteration only after every stage's file of it is complete.
"""
from __future__ import annotations

import errno
import glob
import hashlib
import os
import re
import shutil
import tempfile

from .config import ConfigError

LATEST = "latest_checkpointed_iteration.txt"
FILENAME = "model_optim_rng.pt"


def optimizer_shard_name(dp_rank: int) -> str:
    """The file of a data-parallel rank's distributed-optimizer shard, next to FILENAME."""
    return f"distrib_optim_dp{dp_rank:03d}.pt"


TMP_PREFIX = ".tmp-"


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used or written; the message names the file and the fix."""


def rank_dir(root: str, iteration: int, tp: int, pp: int, num_stages: int) -> str:
    name = f"mp_rank_{tp:02d}" if num_stages == 1 else f"mp_rank_{tp:02d}_{pp:03d}"
    return os.path.join(root, f"iter_{iteration:07d}", name)


class _CountingWriter:
    """A file object that counts the bytes written and keeps the OSError a write raised (torch's
    zip writer swallows it and raises 'unexpected pos' instead)."""

    def __init__(self, f):
        self.f, self.written, self.error = f, 0, None

    def write(self, data) -> int:
        try:
            n = self.f.write(data)
        except OSError as e:
            self.error = e
            raise
        self.written += n
        return n

    def flush(self) -> None:
        self.f.flush()


def atomic_write(path: str, write) -> None:
    """write(file_object) into a temporary file next to `path`, fsync, then rename over it.
    Any OS error (ENOSPC, EDQUOT, EACCES, EIO ...) becomes one CheckpointError; the temporary
    file is removed and `path` is left as it was."""
    directory = os.path.dirname(path) or "."
    tmp, writer = None, None
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=directory)
        with os.fdopen(fd, "wb") as f:
            writer = _CountingWriter(f)
            try:
                write(writer)
                f.flush()
            except Exception as e:  # noqa: BLE001 - name the OS error whatever wrapped it
                if writer.error is not None:
                    raise writer.error from None
                raise e
            os.fsync(f.fileno())
        os.replace(tmp, path)
        tmp = None
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as e:
        raise CheckpointError(write_error(path, e, writer.written if writer else 0)) from None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)


def write_error(path: str, e: OSError, written: int) -> str:
    name = errno.errorcode.get(e.errno, "error") if e.errno else type(e).__name__
    what = e.strerror or str(e)
    fix = {errno.ENOSPC: "free space on that file system or point --save elsewhere",
           errno.EDQUOT: "free space within your quota or point --save elsewhere",
           errno.EACCES: "make the directory writable or point --save elsewhere",
           errno.EROFS: "point --save at a writable file system"}.get(e.errno, "check the disk")
    return (f"cannot write checkpoint file {path}: {what} ({name}) after {written} bytes: {fix}")


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_with_checksum(path: str, write) -> None:
    """atomic_write(path, write) and then its `.sha256` sidecar."""
    atomic_write(path, write)
    digest = sha256_of(path)
    atomic_write(path + ".sha256",
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
    atomic_write(os.path.join(directory, LATEST), lambda f: f.write(f"{iteration}\n".encode()))


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
            shutil.rmtree(os.path.join(save_dir, f"iter_{it:07d}"), ignore_errors=True)


def temporary_files(directory: str) -> list[str]:
    """Leftover `.tmp-` files of interrupted writes in a checkpoint tree (only where this
    module writes: the top level and the iter_*/mp_rank_* directories)."""
    return sorted(glob.glob(os.path.join(directory, TMP_PREFIX + "*")) +
                  glob.glob(os.path.join(directory, "iter_*", "mp_rank_*", TMP_PREFIX + "*")))


def remove_temporary_files(directory: str) -> list[str]:
    """Delete the leftovers of writes that a killed process never finished; returns them.
    Call it only when no process of this job writes into `directory`."""
    removed = []
    for path in temporary_files(directory):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed
