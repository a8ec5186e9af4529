"""Cached numpy index files, built once by whichever process gets there first.

`cached_arrays(dir, description, build)` keys the files by the md5 of a JSON description of all
the parameters; the first process takes a file lock, builds, and writes each array to a temp
file that it renames into place (readers never see a half-written file); the description file is
written last and marks the set complete. Later calls (other ranks, later runs) just memory-map
the arrays. No process group is needed.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import numpy as np

from .errors import DataError


def user_cache_dir() -> Path:
    """$MEGATRON_2BW_CACHE, else ~/.cache/megatron_2bw."""
    root = os.environ.get("MEGATRON_2BW_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "megatron_2bw"


def description_hash(description: dict) -> str:
    text = json.dumps(description, sort_keys=True, indent=1)
    return hashlib.md5(text.encode()).hexdigest()


@contextlib.contextmanager
def file_lock(path: Path):
    """An exclusive advisory lock held while the block runs (blocks until free)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def atomic_save_npy(path: Path, array: np.ndarray) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}.npy")
    np.save(tmp, array, allow_pickle=False)
    os.replace(tmp, path)


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
                  build: Callable[[], dict[str, np.ndarray]]) -> tuple[dict[str, np.ndarray], bool]:
    """Load the arrays `names` for `description` from cache_dir, building them (once, under a
    lock) when missing. Returns (arrays memory-mapped read-only, built_now)."""
    key = description_hash(description)
    stem = f"{key}-{description.get('class', 'index')}"
    paths = {n: cache_dir / f"{stem}-{n}.npy" for n in names}
    marker = cache_dir / f"{stem}-description.json"

    def complete() -> bool:
        return marker.is_file() and all(p.is_file() for p in paths.values())

    built = False
    if not complete():
        with file_lock(cache_dir / f"{stem}.lock"):
            if not complete():
                arrays = build()
                for n, p in paths.items():
                    atomic_save_npy(p, np.ascontiguousarray(arrays[n]))
                atomic_write_bytes(marker, json.dumps(description, sort_keys=True,
                                                      indent=1).encode())
                built = True
    try:
        return {n: np.load(p, mmap_mode="r", allow_pickle=False) for n, p in paths.items()}, built
    except (OSError, ValueError) as e:
        raise DataError(f"{cache_dir}: unreadable cached index {stem} ({e}): delete the files "
                        f"{stem}-* and rerun") from None
