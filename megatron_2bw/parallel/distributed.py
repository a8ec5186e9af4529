"""Starting torch.distributed from torchrun or SLURM environments, device and backend choice.

Set-up order (`start_process_group`): device from the local rank (LOCAL_RANK, SLURM_LOCALID, ...)
made current -> `init_process_group(..., device_id=device)` -> a `Comm` on that device -> the
grid's groups (`ProcessGrid.init_groups`). Nothing touches a GPU before the first step.

Timeouts: the world group and every group the Comm creates get --distributed-timeout-minutes.
On NCCL a timed-out or failed collective is caught by torch's watchdog thread, not by the wait:
`NCCL_ERROR_HANDLING` is what this module sets (unless the user set it) so that the watchdog
tears the process down with torch's report instead of letting it hang (README, "When things go
wrong")."""
from __future__ import annotations

import datetime
import inspect
import os

import torch
import torch.distributed as dist

from megatron_2bw.config.launcher_env import env_rank_world
from megatron_2bw.parallel.comm import WORLD_TIMEOUT, Comm
from megatron_2bw.parallel.devices import default_backend, default_device, is_initialized
from megatron_2bw.parallel.launcher import check_rendezvous, slurm_rendezvous

_HAS_DEVICE_ID = "device_id" in inspect.signature(dist.init_process_group).parameters  # torch>=2.3


# NCCL's asynchronous error handling, unless the user chose otherwise: 3 = the watchdog takes the
# process down on a timeout or an NCCL error (torch's default since 2.2, stated here so that an
# older default or a stray cluster profile cannot turn it off silently), and the watchdog's
# report names the collective, its group and its sequence number
NCCL_ERROR_HANDLING = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}


def nccl_error_handling(environ=os.environ) -> dict[str, str]:
    """Set NCCL_ERROR_HANDLING's variables in `environ` where unset (the user's value wins, as
    does the deprecated NCCL_ASYNC_ERROR_HANDLING spelling); returns those set."""
    added = {}
    for name, value in NCCL_ERROR_HANDLING.items():
        if name not in environ and name.removeprefix("TORCH_") not in environ:
            environ[name] = added[name] = value
    return added


def init_process_group(rank: int, world_size: int, backend: str | None = None,
                       timeout_minutes: float = 10.0, init_method: str | None = None,
                       device: torch.device | None = None, store=None) -> str:
    """Initialize the default group (idempotent). Returns the backend used. With NCCL, `device`
    (the rank's GPU, already current) binds the group to it (`device_id`): communicators are
    created eagerly on the right GPU instead of lazily on whatever device is current. `store`:
    a rendezvous store a launcher already hosts (this rank a client of it), instead of
    `init_method`."""
    backend = backend or default_backend()
    if dist.is_initialized():
        return dist.get_backend()
    extra = {}
    if store is not None:
        extra["store"] = store
    elif init_method is None and world_size == 1 and "MASTER_PORT" not in os.environ:
        extra["store"] = dist.HashStore()  # one process meets no one: no port to collide on
    elif init_method is None:
        check_rendezvous(world_size)
        if "RANK" not in os.environ:
            slurm_rendezvous()
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        init_method = "env://"
    if backend == "nccl":
        nccl_error_handling()
    if backend == "nccl" and device is not None and device.type == "cuda" and _HAS_DEVICE_ID:
        extra["device_id"] = device
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size,
                            init_method=init_method,
                            timeout=datetime.timedelta(minutes=timeout_minutes), **extra)
    WORLD_TIMEOUT["minutes"] = timeout_minutes
    return backend


def start_process_group(rank: int, world_size: int, local_rank: int = 0,
                        backend: str | None = None, timeout_minutes: float = 10.0,
                        init_method: str | None = None, store=None):
    """The set-up order clusters need, in one place: the rank's device from its local rank (made
    current), then the default group bound to it, then a `Comm` on that device carrying the
    timeout (the grid creates its groups through it afterwards). Returns the Comm."""
    backend = backend or default_backend()
    device = default_device(local_rank, backend)
    backend = init_process_group(rank, world_size, backend, timeout_minutes, init_method, device,
                                 store)
    return Comm(device, backend, timeout_minutes)


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
    WORLD_TIMEOUT["minutes"] = None
