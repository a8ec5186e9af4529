"""`deepspeed.accelerator`: `get_accelerator()`, a view that answers for CPU and CUDA.

    from megatron_2bw.deepspeed.accelerator import get_accelerator
    x = x.to(get_accelerator().device_name(local_rank))

The device is CUDA when torch sees one, else the CPU (DeepSpeed's `DS_ACCELERATOR=cpu|cuda`
setting picks one explicitly); nothing calls torch.cuda on the CPU view. Only the calls scripts
make are here (names, devices, seeds, memory counters, streams, the communication backend);
`set_accelerator(view)` replaces the view, as DeepSpeed's does.
"""
from __future__ import annotations

import os
import torch

from megatron_2bw.config import ConfigError

KINDS = ("cpu", "cuda")


class Accelerator:
    """DeepSpeed's accelerator calls for one device kind ("cpu" or "cuda")."""

    def __init__(self, kind: str):
        if kind not in KINDS:
            raise ConfigError(f"accelerator {kind!r} is not supported: use one of {KINDS}")
        self._name = kind
        self._communication_backend_name = "nccl" if kind == "cuda" else "gloo"
        self._cuda = torch.cuda if kind == "cuda" else None

    # -- devices ------------------------------------------------------------------------------
    def device_name(self, device_index=None):
        if self._cuda is None or device_index is None:
            return self._name
        return f"{self._name}:{device_index}"

    def device(self, device_index=None):
        return torch.device(self.device_name(device_index))

    def set_device(self, device_index):
        if self._cuda is not None:
            self._cuda.set_device(device_index)

    def current_device(self):
        return self._cuda.current_device() if self._cuda is not None else 0

    def current_device_name(self):
        if self._cuda is None:
            return "cpu"
        return f"cuda:{self._cuda.current_device()}"

    def device_count(self):
        if self._cuda is not None:
            return self._cuda.device_count()
        return int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", 1)))

    def is_available(self):
        return self._cuda.is_available() if self._cuda is not None else True

    def synchronize(self, device_index=None):
        if self._cuda is not None:
            self._cuda.synchronize(device_index)

    def communication_backend_name(self):
        return self._communication_backend_name

    def on_accelerator(self, tensor):
        return tensor.device.type == self._name

    def pin_memory(self, tensor, align_bytes=1):
        return tensor.pin_memory() if self._cuda is not None else tensor

    # -- random -------------------------------------------------------------------------------
    def random(self):
        return torch.random

    def manual_seed(self, seed):
        if self._cuda is not None:
            return self._cuda.manual_seed(seed)
        return torch.manual_seed(seed)

    def manual_seed_all(self, seed):
        if self._cuda is not None:
            return self._cuda.manual_seed_all(seed)
        return torch.manual_seed(seed)

    def initial_seed(self):
        return self._cuda.initial_seed() if self._cuda is not None else torch.initial_seed()

    def get_rng_state(self, device_index=None):
        if self._cuda is not None:
            return self._cuda.get_rng_state(device_index if device_index is not None else "cuda")
        return torch.get_rng_state()

    def set_rng_state(self, new_state, device_index=None):
        if self._cuda is not None:
            idx = device_index if device_index is not None else "cuda"
            return self._cuda.set_rng_state(new_state, idx)
        return torch.set_rng_state(new_state)

    @property
    def default_generator(self):
        return (self._cuda.default_generators if self._cuda is not None
                else [torch.default_generator])

    # -- memory -------------------------------------------------------------------------------
    def memory_allocated(self, device_index=None):
        if self._cuda is not None:
            return self._cuda.memory_allocated(device_index)
        return _rss()

    def max_memory_allocated(self, device_index=None):
        if self._cuda is not None:
            return self._cuda.max_memory_allocated(device_index)
        return _max_rss()

    def reset_peak_memory_stats(self, device_index=None):
        if self._cuda is not None:
            self._cuda.reset_peak_memory_stats(device_index)

    def empty_cache(self):
        if self._cuda is not None:
            self._cuda.empty_cache()

    def total_memory(self, device_index=None):
        if self._cuda is not None:
            return self._cuda.get_device_properties(device_index or 0).total_memory
        return _host_memory("MemTotal")

    def available_memory(self, device_index=None):
        if self._cuda is not None:
            free, _ = self._cuda.mem_get_info(device_index)
            return free
        return _host_memory("MemAvailable")

    # -- streams, ranges, dtypes --------------------------------------------------------------
    def stream(self, stream):
        import contextlib
        return self._cuda.stream(stream) if self._cuda is not None else contextlib.nullcontext()

    def current_stream(self, device_index=None):
        return self._cuda.current_stream(device_index) if self._cuda is not None else None

    default_stream = current_stream

    def range_push(self, msg):
        if self._cuda is not None:
            self._cuda.nvtx.range_push(msg)

    def range_pop(self):
        if self._cuda is not None:
            self._cuda.nvtx.range_pop()

    def lazy_call(self, callback):
        return self._cuda._lazy_call(callback) if self._cuda is not None else callback()

    def is_bf16_supported(self):
        return self._cuda.is_bf16_supported() if self._cuda is not None else True

    def is_fp16_supported(self):
        return self._cuda is not None

    def supported_dtypes(self):
        dtypes = [torch.float, torch.bfloat16]
        return dtypes + [torch.half] if self.is_fp16_supported() else dtypes

    def is_triton_supported(self):
        return False

    def __repr__(self):
        return f"Accelerator({self._name!r})"


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return _max_rss()


def _max_rss() -> int:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _host_memory(name: str) -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


_CURRENT = {}


def _pick() -> str:
    chosen = os.environ.get("DS_ACCELERATOR")
    if chosen:
        if chosen not in KINDS:
            raise ConfigError(f"DS_ACCELERATOR={chosen!r} is not supported here: use one of "
                              f"{KINDS} or leave it unset")
        return chosen
    return "cuda" if torch.cuda.is_available() else "cpu"


def get_accelerator() -> Accelerator:
    """The process's accelerator view (made on first use)."""
    if "view" not in _CURRENT:
        _CURRENT["view"] = Accelerator(_pick())
    return _CURRENT["view"]


def set_accelerator(view: Accelerator) -> None:
    _CURRENT["view"] = view


def is_current_accelerator_supported() -> bool:
    return get_accelerator()._name in KINDS


DeepSpeedAccelerator = Accelerator
__all__ = ["Accelerator", "DeepSpeedAccelerator", "get_accelerator",
           "is_current_accelerator_supported", "set_accelerator"]
