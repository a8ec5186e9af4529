"""Cached numpy index files, built once per node without file locks (no process group needed).

`cached_arrays(dir, description, names, build)` keys the files by the md5 of a JSON description
of all the parameters:

    {md5}-{class}-{name}.npy         one per array
    {md5}-{class}-description.json   written last: marks the set complete

Who builds: the process with local rank 0 (torchrun's LOCAL_RANK, SLURM_LOCALID, ...; a plain
`python` run is local rank 0), or the one the caller names (`builder`: the pretrain script
names the node's first rank that reads data, training/build.py `data_role`), builds the missing
files; every other process waits for the description file (polling with backoff) and then
memory-maps the arrays. A builder writes each
file under a name unique to it (host, pid, random suffix; fs.py), fsyncs it and publishes it
create-if-absent (`fs.atomic_create`: a hard link to the final name, which fails when the name
exists), so readers never see a half-written file and several builders (one per node on a
shared filesystem, or two jobs at once) are harmless: the first file published under a name is
the one everybody keeps, the others are dropped, and no builder replaces a file another node may
already have open (a rename over it would; on NFS that reader gets ESTALE). Nothing relies on
`fcntl.flock`, which many cluster filesystems do not implement.

A waiter gives up after `timeout_s` with a one-line error naming the file and the fix (a
`--data-cache-path` every rank can see): that is what happens when the ranks do not share the
directory, or when the builder died before finishing.
"""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Callable

import numpy as np

from megatron_2bw.data.errors import DataError
from megatron_2bw.fs import atomic_create_bytes, atomic_create_npy, writable_problem

WAIT_TIMEOUT_S = 30 * 60.0  # building a large corpus's indices takes minutes


def description_hash(description: dict) -> str:
    text = json.dumps(description, sort_keys=True, indent=1)
    return hashlib.md5(text.encode()).hexdigest()


def is_local_builder() -> bool:
    """True on the process that builds caches on this node: local rank 0."""
    from megatron_2bw.config.launcher_env import env_rank_world
    return env_rank_world()[2] == 0


def wait_until(ready: Callable[[], bool], path: Path, timeout_s: float = WAIT_TIMEOUT_S,
               sleep: Callable[[float], None] = time.sleep) -> None:
    """Poll `ready()` with backoff (50 ms doubling to 2 s) until it holds; after timeout_s raise
    a one-line DataError naming `path` and the fix."""
    deadline, delay = time.monotonic() + timeout_s, 0.05
    while not ready():
        if time.monotonic() >= deadline:
            raise DataError(f"{path}: not built after {timeout_s:g} s of waiting for this "
                            "node's builder (its first rank that reads data) to build it: make "
                            "sure every rank sees the same directory (pass --data-cache-path "
                            "DIR on a filesystem all nodes share) and that the builder did not "
                            "fail")
        sleep(delay)
        delay = min(2 * delay, 2.0)


def writable_dir(preferred: Path, fallback: Path) -> Path:
    """preferred if it can be created and written, else fallback (e.g. read-only data dirs)."""
    for d in (preferred, fallback):
        if writable_problem(d) is None:
            return d
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
            for n, p in paths.items():  # another builder's file, when first, is kept
                atomic_create_npy(p, np.ascontiguousarray(arrays[n]))
            atomic_create_bytes(marker, json.dumps(description, sort_keys=True,
                                                   indent=1).encode())
            built = True
        else:
            wait_until(complete, marker, timeout_s)
    try:
        return {n: np.load(p, mmap_mode="r", allow_pickle=False) for n, p in paths.items()}, built
    except (OSError, ValueError) as e:
        raise DataError(f"{cache_dir}: unreadable cached index {stem} ({e}): delete the files "
                        f"{stem}-* and rerun") from None
