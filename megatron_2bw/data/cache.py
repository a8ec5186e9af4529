"""Cached numpy index files, built once per node without file locks (no process group needed).

`cached_arrays(dir, description, names, build)` keys the files by the md5 of a JSON description
of all the parameters:

    {md5}-{class}-{name}.npy         one per array
    {md5}-{class}-description.json   written last: marks the set complete

Who builds: the process with local rank 0 (torchrun's LOCAL_RANK, SLURM_LOCALID, ...; a plain
`python` run is local rank 0) builds the missing files; every other process waits for the
description file (polling with backoff) and then memory-maps the arrays. A builder writes each
file under a name unique to it (host, pid, random suffix), fsyncs it and renames it into place,
so readers never see a half-written file and several builders (one per node on a shared
filesystem, or two jobs at once) are harmless: they write identical bytes and the last rename
wins. Nothing relies on `fcntl.flock`, which many cluster filesystems do not implement.

A waiter gives up after `timeout_s` with a one-line error naming the file and the fix (a
`--data-cache-path` every rank can see): that is what happens when the ranks do not share the
directory, or when local rank 0 died before finishing.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
import uuid
from pathlib import Path
from typing import Callable

import numpy as np

from .errors import DataError

WAIT_TIMEOUT_S = 30 * 60.0  # building a large corpus's indices takes minutes


def user_cache_dir() -> Path:
    """$MEGATRON_2BW_CACHE, else ~/.cache/megatron_2bw."""
    root = os.environ.get("MEGATRON_2BW_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "megatron_2bw"


def description_hash(description: dict) -> str:
    text = json.dumps(description, sort_keys=True, indent=1)
    return hashlib.md5(text.encode()).hexdigest()


def is_local_builder() -> bool:
    """True on the process that builds caches on this node: local rank 0."""
    from ..parallel.distributed import env_rank_world
    return env_rank_world()[2] == 0


def unique_temp(path: Path) -> Path:
    """A sibling of `path` no other process (on any host) uses: `NAME.tmp-HOST-PID-RANDOM`."""
    return path.with_name(f"{path.name}.tmp-{socket.gethostname()}-{os.getpid()}-"
                          f"{uuid.uuid4().hex[:8]}")


def _replace_durably(tmp: Path, path: Path) -> None:
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = unique_temp(path)
    try:
        tmp.write_bytes(data)
        _replace_durably(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_save_npy(path: Path, array: np.ndarray) -> None:
    tmp = unique_temp(path)
    try:
        with open(tmp, "wb") as f:
            np.save(f, array, allow_pickle=False)
        _replace_durably(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


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
        return True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def wait_until(ready: Callable[[], bool], path: Path, timeout_s: float = WAIT_TIMEOUT_S,
               sleep: Callable[[float], None] = time.sleep) -> None:
    """Poll `ready()` with backoff (50 ms doubling to 2 s) until it holds; after timeout_s raise
    a one-line DataError naming `path` and the fix."""
    deadline, delay = time.monotonic() + timeout_s, 0.05
    while not ready():
        if time.monotonic() >= deadline:
            raise DataError(f"{path}: not built after {timeout_s:g} s of waiting for local rank 0 "
                            "to build it: make sure every rank sees the same directory (pass "
                            "--data-cache-path DIR on a filesystem all nodes share) and that "
                            "local rank 0 did not fail")
        sleep(delay)
        delay = min(2 * delay, 2.0)


def writable_dir(preferred: Path, fallback: Path) -> Path:
    """preferred if it can be created and written, else fallback (e.g. read-only data dirs)."""
    for d in (preferred, fallback):
        try:
            d.mkdir(parents=True, exist_ok=True)
            if os.access(d, os.W_OK):
                return d
        except OSError:
            continue
    raise DataError(f"{preferred}: cannot write the index cache there or in {fallback}: pass "
                    "--data-cache-path DIR with a writable directory")


def cached_arrays(cache_dir: Path, description: dict, names: tuple[str, ...],
                  build: Callable[[], dict[str, np.ndarray]], builder: bool | None = None,
                  timeout_s: float = WAIT_TIMEOUT_S) -> tuple[dict[str, np.ndarray], bool]:
    """Load the arrays `names` for `description` from cache_dir; when missing, build them
    (builder: default local rank 0) or wait for the builder. Returns (arrays memory-mapped
    read-only, built_now)."""
    key = description_hash(description)
    stem = f"{key}-{description.get('class', 'index')}"
    paths = {n: cache_dir / f"{stem}-{n}.npy" for n in names}
    marker = cache_dir / f"{stem}-description.json"

    def complete() -> bool:
        return marker.is_file() and all(p.is_file() for p in paths.values())

    built = False
    if not complete():
        if builder if builder is not None else is_local_builder():
            cache_dir.mkdir(parents=True, exist_ok=True)
            arrays = build()
            for n, p in paths.items():
                atomic_save_npy(p, np.ascontiguousarray(arrays[n]))
            atomic_write_bytes(marker, json.dumps(description, sort_keys=True,
                                                  indent=1).encode())
            built = True
        else:
            wait_until(complete, marker, timeout_s)
    try:
        return {n: np.load(p, mmap_mode="r", allow_pickle=False) for n, p in paths.items()}, built
    except (OSError, ValueError) as e:
        raise DataError(f"{cache_dir}: unreadable cached index {stem} ({e}): delete the files "
                        f"{stem}-* and rerun") from None
