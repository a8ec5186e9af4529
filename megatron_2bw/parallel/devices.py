"""Which backend and which device a rank communicates on (NCCL: the rank's own GPU; gloo: the
CPU), and whether a process group is up. Touches no GPU unless told to make it current."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_2bw.config import ConfigError


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def backend_device(backend: str | None, local_rank: int = 0) -> torch.device:
    """The device a backend communicates on: NCCL the rank's own GPU (cuda:<local rank>, modulo
    the GPUs this process sees, so `--gpus-per-task=1` works too), gloo the CPU. Pure: sets
    nothing."""
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ConfigError("the nccl backend needs CUDA GPUs and this process sees none: use "
                             "--distributed-backend gloo or check CUDA_VISIBLE_DEVICES")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def default_device(local_rank: int = 0, backend: str | None = None) -> torch.device:
    """`backend_device`, made the current CUDA device when it is a GPU (NCCL, all_gather_object
    and the CUDA caching allocator use the current device)."""
    device = backend_device(backend or default_backend(), local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def to_device(obj, device):
    """Move a tensor, or a tuple/list/dict of them, to `device` (non-blocking)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj
