"""Starting torch.distributed from torchrun or SLURM environments, device and backend choice."""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


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
        if "RANK" not in os.environ:
            slurm_rendezvous()
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        init_method = "env://"
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size,
                            init_method=init_method,
                            timeout=datetime.timedelta(minutes=timeout_minutes))
    return backend
