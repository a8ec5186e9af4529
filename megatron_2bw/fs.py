"""The one owner of how the product writes files: atomically, under unique temporary names, into
directories it has checked, and where its caches live. Every write of the package goes through
here or through the checkpoint storage layer (checkpoint/dist/storage.py, DCP's writer);
tests/unit/test_layout.py finds any other `torch.save` or `open(..., "w")`.

    atomic_write(path, write)      write(file) into a temporary sibling, fsync, rename over
                                   `path`, fsync the directory; returns the sha256 of the bytes
    atomic_write_bytes(path, b)    the same for bytes; atomic_save_npy(path, array) for numpy
    atomic_build_dir(final, build) build a whole directory under a temporary name, then rename
    unique_temp(path)              `.tmp-NAME-HOST-PID-RANDOM` next to `path`: unique across
                                   the hosts of a shared filesystem, so no locks are needed
    fsync_directory(dir)           make renames and new entries in `dir` durable
    writable_problem(dir)          why `dir` cannot be created and written (None when it can)
    user_cache_dir()               $MEGATRON_2BW_CACHE, else ~/.cache/megatron_2bw

A reader sees the old file or the new one, never half of one; a writer killed mid-write leaves
only a `.tmp-` name (TMP_PREFIX), which the checkpoint start-up removes. A failed write is a
`WriteError` (an OSError) that keeps the OS error and the bytes written, for a one-line message.
Must not import: anything of the package (it is the bottom layer).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import socket
import uuid
from pathlib import Path
from typing import Callable

TMP_PREFIX = ".tmp-"


class WriteError(OSError):
    """A write that failed: `cause` (the OSError: ENOSPC, EDQUOT, EACCES ...) after `written`
    bytes of `path`."""

    def __init__(self, path: str, cause: OSError, written: int):
        super().__init__(cause.errno, cause.strerror or str(cause))
        self.path, self.cause, self.written = path, cause, written


def user_cache_dir() -> Path:
    """$MEGATRON_2BW_CACHE, else ~/.cache/megatron_2bw."""
    root = os.environ.get("MEGATRON_2BW_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "megatron_2bw"


def unique_temp(path) -> Path:
    """A sibling of `path` no other process (on any host) uses: `.tmp-NAME-HOST-PID-RANDOM`."""
    path = Path(path)
    return path.with_name(f"{TMP_PREFIX}{path.name}-{socket.gethostname()}-{os.getpid()}-"
                          f"{uuid.uuid4().hex[:8]}")


def fsync_directory(directory) -> None:
    """Make the directory's entries (files created or renamed in it) durable."""
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class HashingWriter:
    """A file object that counts and hashes the bytes written (the checksum needs no re-read) and
    keeps the OSError a write raised (torch's zip writer swallows it and raises 'unexpected pos'
    instead)."""

    def __init__(self, f):
        self.f, self.written, self.error = f, 0, None
        self.sha = hashlib.sha256()

    def write(self, data) -> int:
        try:
            n = self.f.write(data)
        except OSError as e:
            self.error = e
            raise
        self.sha.update(data)
        self.written += n
        return n

    def flush(self) -> None:
        self.f.flush()

    def tell(self) -> int:
        return self.f.tell()

    def fileno(self) -> int:
        return self.f.fileno()


def atomic_write(path, write: Callable) -> str:
    """write(file_object) into a unique temporary sibling of `path`, fsync, rename over `path`,
    fsync the directory; returns the sha256 of what was written. Any OS error becomes one
    WriteError; the temporary file is removed and `path` is left as it was."""
    path = str(path)
    directory = os.path.dirname(path) or "."
    tmp, writer = None, None
    try:
        os.makedirs(directory, exist_ok=True)
        tmp = str(unique_temp(path))
        with open(tmp, "xb") as f:
            writer = HashingWriter(f)
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
        fsync_directory(directory)
    except WriteError:
        raise
    except OSError as e:
        raise WriteError(path, e, writer.written if writer else 0) from None
    finally:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
    return writer.sha.hexdigest()


def atomic_write_bytes(path, data: bytes) -> str:
    return atomic_write(path, lambda f: f.write(data))


def atomic_save_npy(path, array) -> None:
    import numpy as np
    atomic_write(path, lambda f: np.save(f, array, allow_pickle=False))


def atomic_build_dir(final: Path, build: Callable[[Path], None]) -> bool:
    """Build a directory with build(tmp_dir) and rename it to `final`. Returns False when another
    builder's directory got there first (ours is discarded; theirs is complete)."""
    tmp = unique_temp(final)
    tmp.mkdir(parents=True)
    try:
        build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if final.is_dir():
                return False
            raise
        fsync_directory(final.parent)
        return True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def writable_problem(path) -> str | None:
    """Create `path` if needed; what is wrong ("is a file, not a directory", "cannot be created
    (Permission denied)", "is not writable") when it cannot be written, else None."""
    path = str(path)
    if os.path.exists(path) and not os.path.isdir(path):
        return "is a file, not a directory"
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        return f"cannot be created ({e.strerror})"
    if not os.access(path, os.W_OK | os.X_OK):
        return "is not writable"
    return None
