"""Starting torch.distributed from torchrun or SLURM environments, device and backend choice.

Set-up order (`start_process_group`): device from the local rank (LOCAL_RANK, SLURM_LOCALID, ...)
made current -> `init_process_group(..., device_id=device)` -> a `Comm` on that device -> the
grid's groups (`ProcessGrid.init_groups`). Nothing touches a GPU before the first step."""
from __future__ import annotations

import datetime
import inspect
import os

import torch
import torch.distributed as dist

from ..config import ConfigError

_HAS_DEVICE_ID = "device_id" in inspect.signature(dist.init_process_group).parameters  # torch>=2.3


LAUNCHER_VARS = (("RANK", "WORLD_SIZE", "LOCAL_RANK"),   # torchrun, torch multiprocessing
                 ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
                 ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"))


def env_rank_world() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun, SLURM or MPI variables; (0, 1, 0) if none."""
    for rank_var, world_var, local_var in LAUNCHER_VARS:
        if rank_var in os.environ and world_var in os.environ:
            return (int(os.environ[rank_var]), int(os.environ[world_var]),
                    int(os.environ.get(local_var, 0)))
    return 0, 1, 0


def launched() -> bool:
    """True when a launcher (torchrun, srun, mpirun, torch multiprocessing) started this process,
    i.e. its rank variables are set; False for a plain `python pretrain_gpt.py` from a shell."""
    return any(r in os.environ and w in os.environ for r, w, _ in LAUNCHER_VARS)


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list ("gpu[01-03,07],login1") as host names, like
    `scontrol show hostnames`."""
    hosts, i, n = [], 0, len(nodelist)
    while i < n:
        j = i
        while j < n and nodelist[j] not in ",[":
            j += 1
        prefix = nodelist[i:j]
        if j < n and nodelist[j] == "[":
            k = nodelist.index("]", j)
            for part in nodelist[j + 1:k].split(","):
                lo, _, hi = part.partition("-")
                if hi:
                    hosts += [f"{prefix}{x:0{len(lo)}d}" for x in range(int(lo), int(hi) + 1)]
                else:
                    hosts.append(prefix + lo)
            j = k + 1
        elif prefix:
            hosts.append(prefix)
        i = j + 1 if j < n and nodelist[j] == "," else j
    return hosts


def slurm_rendezvous() -> None:
    """Under plain `srun python ...` (no torchrun): MASTER_ADDR = first host of the job,
    MASTER_PORT derived from the job id, unless already set."""
    if "SLURM_JOB_NODELIST" in os.environ and "MASTER_ADDR" not in os.environ:
        os.environ["MASTER_ADDR"] = expand_nodelist(os.environ["SLURM_JOB_NODELIST"])[0]
    if "SLURM_JOB_ID" in os.environ and "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(20000 + int(os.environ["SLURM_JOB_ID"]) % 20000)


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


def init_process_group(rank: int, world_size: int, backend: str | None = None,
                       timeout_minutes: float = 10.0, init_method: str | None = None,
                       device: torch.device | None = None) -> str:
    """Initialize the default group (idempotent). Returns the backend used. With NCCL, `device`
    (the rank's GPU, already current) binds the group to it (`device_id`): communicators are
    created eagerly on the right GPU instead of lazily on whatever device is current."""
    backend = backend or default_backend()
    if dist.is_initialized():
        return dist.get_backend()
    if init_method is None:
        if "RANK" not in os.environ:
            slurm_rendezvous()
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        init_method = "env://"
    extra = {}
    if backend == "nccl" and device is not None and device.type == "cuda" and _HAS_DEVICE_ID:
        extra["device_id"] = device
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size,
                            init_method=init_method,
                            timeout=datetime.timedelta(minutes=timeout_minutes), **extra)
    return backend


def start_process_group(rank: int, world_size: int, local_rank: int = 0,
                        backend: str | None = None, timeout_minutes: float = 10.0,
                        init_method: str | None = None):
    """The set-up order clusters need, in one place: the rank's device from its local rank (made
    current), then the default group bound to it, then a `Comm` on that device (the grid creates
    its groups through it afterwards). Returns the Comm."""
    from .comm import Comm
    backend = backend or default_backend()
    device = default_device(local_rank, backend)
    backend = init_process_group(rank, world_size, backend, timeout_minutes, init_method, device)
    return Comm(device, backend)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def current_rank_world() -> tuple[int, int]:
    """This process's rank and the world size: from the process group if it is up, else from the
    launcher's environment (torchrun / SLURM / MPI), else (0, 1)."""
    if is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank, world, _ = env_rank_world()
    return rank, world


def destroy_process_group() -> None:
    if is_initialized():
        dist.destroy_process_group()
