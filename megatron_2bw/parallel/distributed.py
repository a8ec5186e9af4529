"""Starting torch.distributed from torchrun or SLURM environments, device and backend choice."""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def env_rank_world() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun, SLURM or MPI variables; (0, 1, 0) if none."""
    for rank_var, world_var, local_var in (("RANK", "WORLD_SIZE", "LOCAL_RANK"),
                                           ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
                                           ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                                            "OMPI_COMM_WORLD_LOCAL_RANK")):
        if rank_var in os.environ and world_var in os.environ:
            return (int(os.environ[rank_var]), int(os.environ[world_var]),
                    int(os.environ.get(local_var, 0)))
    return 0, 1, 0


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def default_device(local_rank: int = 0, backend: str | None = None) -> torch.device:
    backend = backend or default_backend()
    if backend == "nccl" and torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_process_group(rank: int, world_size: int, backend: str | None = None,
                       timeout_minutes: float = 10.0, init_method: str | None = None) -> str:
    """Initialize the default group (idempotent). Returns the backend used."""
    backend = backend or default_backend()
    if dist.is_initialized():
        return dist.get_backend()
    if init_method is None:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        init_method = "env://"
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size,
                            init_method=init_method,
                            timeout=datetime.timedelta(minutes=timeout_minutes))
    return backend
