"""`deepspeed.comm` basics over the communication layer (parallel/comm.py `Comm`):

    import megatron_2bw.deepspeed.comm as dist
    dist.all_reduce(t); dist.get_rank(); dist.barrier()

init_distributed, is_initialized, get_rank, get_world_size, get_local_rank, barrier, all_reduce
(ReduceOp.SUM / AVG / MAX / MIN; async_op runs it at once), broadcast, all_gather, send, recv,
and the groups of the grid through the engine's `mpu` (engine.grid). Collectives run on the
process group's device (the rank's GPU under NCCL, the CPU under gloo), with the layer's error
lines.
"""
from __future__ import annotations

from megatron_2bw.config import ConfigError
from megatron_2bw.deepspeed.initialize import init_distributed
from megatron_2bw.parallel.comm import Comm
from megatron_2bw.parallel.devices import is_initialized
from megatron_2bw.parallel.launcher import env_rank_world


class ReduceOp:
    """DeepSpeed's reduce operations, by the names the communication layer takes."""
    SUM, AVG, MAX, MIN = "sum", "avg", "max", "min"


def _comm() -> Comm:
    return Comm()


def _op(op) -> str:
    name = str(getattr(op, "name", op)).lower()   # torch's ReduceOp members have a name
    if name not in ("sum", "avg", "max", "min"):
        raise ConfigError(f"deepspeed.comm.all_reduce: op {op!r} is not supported here: use "
                          "ReduceOp.SUM, AVG, MAX or MIN")
    return name


def _by_group(what: str, group):
    if group is not None:
        raise ConfigError(f"deepspeed.comm.{what}(group=...) is not supported: ask the engine's "
                          "mpu (engine.grid.get_data_parallel_rank(), "
                          "get_data_parallel_world_size(), ...)")


def is_available() -> bool:
    return True


def get_rank(group=None) -> int:
    _by_group("get_rank", group)
    return _comm().rank


def get_world_size(group=None) -> int:
    _by_group("get_world_size", group)
    return _comm().world_size


def get_local_rank() -> int:
    return env_rank_world()[2]


def barrier(group=None, **_):
    _comm().barrier()


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    """In place over `group` (default the world); AVG divides the sum by the group's size and
    MIN is minus the MAX of minus the tensor (the layer reduces by sum and max)."""
    name, comm = _op(op), _comm()
    if name == "min":
        tensor.neg_()
    work = comm.all_reduce(tensor, group=group, op={"avg": "sum", "min": "max"}.get(name, name))
    if name == "min":
        tensor.neg_()
    if name == "avg":
        size = tensor.new_ones(())
        comm.all_reduce(size, group=group)
        tensor.div_(size)
    return work


def broadcast(tensor, src, group=None, async_op=False):
    return _comm().broadcast(tensor, src, group=group)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    return _comm().all_gather(tensor_list, tensor, group=group)


def send(tensor, dst, group=None, tag=0):
    _comm().send(tensor, dst, group=group)


def recv(tensor, src=None, group=None, tag=0):
    _comm().recv(tensor, src, group=group)


__all__ = ["ReduceOp", "all_gather", "all_reduce", "barrier", "broadcast", "get_local_rank",
           "get_rank", "get_world_size", "init_distributed", "is_available", "is_initialized",
           "recv", "send"]
