"""CPU runs: keep freed heap memory in the process, as the CUDA caching allocator does on GPUs.

glibc hands memory freed at the top of the heap back to the kernel (trimming) and serves large
blocks with fresh mmap()s, and then every new page costs a fault and zeroing on first touch. A
schedule whose activation stash grows and shrinks every batch therefore pays for its stash again
at every batch: GPipe (all m microbatches stashed) took about 6,000 minor page faults per batch
on stage 0 of bench/plan_accuracy.py's model, and its forwards ran about 35% slower than 2BW's
(which reuses the same few blocks). `keep_freed_memory()` raises glibc's trim threshold and pins
its mmap threshold (so it stops adapting), once per process; faults per batch drop to a handful.
The cost: the process keeps its peak heap, which a training process reaches again every batch
anyway. `MEGATRON_2BW_KEEP_FREED_MEMORY=0` turns it off; it does nothing without glibc.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
TRIM_BYTES = 1 << 30          # keep up to 1 GiB of freed memory at the top of the heap
MMAP_BYTES = 32 << 20         # glibc's largest mmap threshold (64-bit): smaller blocks use the heap

_done: bool | None = None


def keep_freed_memory() -> bool:
    """Tune glibc once for this process; True when the settings are in effect."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if os.environ.get("MEGATRON_2BW_KEEP_FREED_MEMORY", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl without mallopt): nothing to do
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = bool(mallopt(M_TRIM_THRESHOLD, TRIM_BYTES)) and bool(mallopt(M_MMAP_THRESHOLD,
                                                                          MMAP_BYTES))
    return _done


__all__ = ["keep_freed_memory"]
