"""Peak memory per log interval, per pipeline stage.

    device   "memory GB per stage"                        "reserved GB per stage"
    cuda     torch.cuda.max_memory_allocated              torch.cuda.max_memory_reserved
    cpu      peak resident set size (VmHWM)               (not logged)

Each read resets the peaks (`torch.cuda.reset_peak_memory_stats`; on Linux writing 5 to
/proc/self/clear_refs resets VmHWM), so a value is the peak of the interval since the previous
read, not of the whole run. Where the kernel refuses the reset, the CPU value is the run's peak
(`ru_maxrss`). GiB (2^30 bytes) throughout; a stage's value is the maximum over its tensor and
data-parallel ranks.
"""
from __future__ import annotations

import re
import resource

import torch

GB = 2 ** 30


def memory_peaks(device) -> tuple[float, float | None]:
    """(allocated peak, reserved peak) GiB on CUDA; (peak RSS, None) on the CPU; both since the
    last `reset_memory_peaks`."""
    device = torch.device(device)
    if device.type == "cuda":
        return (torch.cuda.max_memory_allocated(device) / GB,
                torch.cuda.max_memory_reserved(device) / GB)
    return _peak_rss_kb() * 1024 / GB, None


def reset_memory_peaks(device) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS to the current RSS (Linux >= 4.0)
    except OSError:
        pass  # not Linux, or not allowed: the CPU value stays the run's peak


def _peak_rss_kb() -> int:
    try:
        with open("/proc/self/status") as f:
            found = re.search(r"^VmHWM:\s+(\d+)\s+kB", f.read(), re.M)
        if found:
            return int(found.group(1))
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KB on Linux


def memory_per_stage(grid, device) -> dict[str, list[float]]:
    """Collective: this interval's peaks per pipeline stage ({"memory GB per stage": [...],
    and on CUDA "reserved GB per stage": [...]}), then a reset of this rank's peaks."""
    allocated, reserved = memory_peaks(device)
    reset_memory_peaks(device)
    rows = grid.comm.gather_floats([allocated, -1.0 if reserved is None else reserved])
    out = {"memory GB per stage": [0.0] * grid.pipeline}
    if reserved is not None:
        out["reserved GB per stage"] = [0.0] * grid.pipeline
    for r, (a, res) in enumerate(rows):
        s = grid.coords(r)[1]
        out["memory GB per stage"][s] = max(out["memory GB per stage"][s], a)
        if reserved is not None:
            out["reserved GB per stage"][s] = max(out["reserved GB per stage"][s], res)
    return out
