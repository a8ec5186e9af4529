"""`deepspeed.comm` over the communication layer (parallel/comm.py `Comm`):

    import megatron_2bw.deepspeed.comm as dist
    dist.all_reduce(t); dist.get_rank(); dist.barrier(); dist.destroy_process_group()

DeepSpeed 0.19.8's deepspeed/comm public names, each provided or refused in one line naming what
to use (`REFUSED`; tests/unit/test_deepspeed_comm_names.py reads the installed package's names):

- provided: init_distributed, is_initialized, is_available, destroy_process_group (DeepSpeed's
  distributed test harness calls it at every teardown), get_rank / get_world_size (of a group
  too), get_local_rank, get_global_rank, get_all_ranks_from_group, get_world_group, new_group,
  barrier, monitored_barrier, all_reduce (ReduceOp.SUM / AVG / MAX / MIN), inference_all_reduce,
  all_reduce_coalesced, reduce, broadcast, all_gather, gather, all_gather_into_tensor,
  allgather_fn, all_gather_coalesced, reduce_scatter_tensor, reduce_scatter_fn, reduce_scatter
  (SUM / AVG), send, recv, isend, irecv, P2POp, batch_isend_irecv, all_gather_object,
  broadcast_object_list, the has_* probes, the *_from_launcher readers, ReduceOp and the backend
  names (NCCL_BACKEND, ...);
- refused: DeepSpeed's communication logger (configure, log_summary, timed_op, ...), its backend
  objects and selection, scatter and all-to-all, device meshes, and the cloud environment
  patches.

Collectives run on the process group's device (the rank's GPU under NCCL, the CPU under gloo),
with the layer's error lines; `async_op=True` returns a work to wait on (the call may have
completed already).
"""
from __future__ import annotations

import torch

from megatron_2bw.config import ConfigError
from megatron_2bw.config.launcher_env import env_rank_world
from megatron_2bw.deepspeed.initialize import (  # noqa: F401 (DeepSpeed's names)
    default_pg_timeout, init_distributed)
from megatron_2bw.parallel.comm import Comm
from megatron_2bw.parallel.devices import is_initialized  # noqa: F401 (DeepSpeed's name)
from megatron_2bw.parallel.distributed import destroy_process_group as _destroy

NCCL_BACKEND, GLOO_BACKEND, MPI_BACKEND = "nccl", "gloo", "mpi"
CCL_BACKEND, HCCL_BACKEND, SCCL_BACKEND = "ccl", "hccl", "sccl"
TORCH_DISTRIBUTED_DEFAULT_PORT = 29500


class ReduceOp:
    """DeepSpeed's reduce operations; SUM, AVG, MAX and MIN are the ones reduced here."""
    SUM, AVG, MAX, MIN = "sum", "avg", "max", "min"
    PRODUCT, BAND, BOR, BXOR, UNUSED = "product", "band", "bor", "bxor", "unused"


class _Done:
    """The work of an `async_op=True` call that completed before returning."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _comm() -> Comm:
    return Comm()


def _op(op, what: str = "all_reduce") -> str:
    name = str(getattr(op, "name", op)).lower()   # torch's ReduceOp members have a name
    if name not in ("sum", "avg", "max", "min"):
        raise ConfigError(f"deepspeed.comm.{what}: op {op!r} is not supported here: use "
                          "ReduceOp.SUM, AVG, MAX or MIN")
    return name


def _work(work, async_op: bool):
    return (work if work is not None else _Done()) if async_op else None


def _world_only(what: str, group) -> None:
    if group is not None:
        raise ConfigError(f"deepspeed.comm.{what}(group=...) is not supported: it runs over the "
                          "world (group=None)")


def is_available() -> bool:
    return True


def destroy_process_group(group=None) -> None:
    """End the process group (a no-op when none is up), as DeepSpeed's test harness does at
    every teardown."""
    _world_only("destroy_process_group", group)
    _destroy()


# -- ranks and groups -----------------------------------------------------------------------------
def get_rank(group=None) -> int:
    """This process's rank in `group` (None: the world); -1 outside it, as torch's."""
    comm = _comm()
    if group is None:
        return comm.rank
    ranks = comm.group_ranks(group)
    return ranks.index(comm.rank) if comm.rank in ranks else -1


def get_world_size(group=None) -> int:
    return len(_comm().group_ranks(group)) if group is not None else _comm().world_size


def get_local_rank() -> int:
    return env_rank_world()[2]


def get_global_rank(group=None, group_rank=0) -> int:
    return _comm().group_ranks(group)[group_rank]


def get_all_ranks_from_group(group=None) -> list[int]:
    return _comm().group_ranks(group)


def get_world_group():
    return _comm().world_group


def new_group(ranks):
    """A group of `ranks` (global); collective over the world, as torch's."""
    return _comm().new_group(list(ranks))


def get_world_rank_from_launcher() -> int:
    return env_rank_world()[0]


def get_world_size_from_launcher() -> int:
    return env_rank_world()[1]


def get_local_rank_from_launcher() -> int:
    return env_rank_world()[2]


def barrier(group=None, async_op=False, device_ids=None):
    _world_only("barrier", group)
    _comm().barrier()
    return _work(None, async_op)


def monitored_barrier(group=None, timeout=None, wait_all_ranks=False):
    return barrier(group)


# -- collectives ----------------------------------------------------------------------------------
def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    """In place over `group` (default the world); AVG divides the sum by the group's size and
    MIN is minus the MAX of minus the tensor (the layer reduces by sum and max)."""
    name, comm = _op(op), _comm()
    if name in ("sum", "max"):
        return _work(comm.all_reduce(tensor, group=group, op=name, async_op=async_op), async_op)
    if name == "min":
        tensor.neg_()
    comm.all_reduce(tensor, group=group, op={"avg": "sum", "min": "max"}[name])
    if name == "min":
        tensor.neg_()
    if name == "avg":
        tensor.div_(get_world_size(group))
    return _work(None, async_op)


def inference_all_reduce(tensor, op=ReduceOp.SUM, group=None):
    return all_reduce(tensor, op, group)


def all_reduce_coalesced(tensors, op=ReduceOp.SUM, group=None, async_op=False):
    for t in tensors:
        all_reduce(t, op, group)
    return _work(None, async_op)


def reduce(tensor, dst, op=ReduceOp.SUM, group=None, async_op=False):
    """The reduction lands on `dst` (here on every rank of the group: an all-reduce)."""
    return all_reduce(tensor, op, group, async_op)


def broadcast(tensor, src, group=None, async_op=False):
    return _work(_comm().broadcast(tensor, src, group=group), async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    return _work(_comm().all_gather(tensor_list, tensor, group=group), async_op)


def gather(tensor, gather_list=None, dst=0, group=None, async_op=False):
    """Every rank's `tensor` into `dst`'s `gather_list` (an all-gather underneath)."""
    parts = gather_list if gather_list is not None else \
        [torch.empty_like(tensor) for _ in range(get_world_size(group))]
    return all_gather(parts, tensor, group, async_op)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    return _work(_comm().all_gather_into(output_tensor, input_tensor, group=group,
                                         async_op=async_op), async_op)


def allgather_fn(output_tensor, input_tensor, group=None, async_op=False, debug=None):
    return all_gather_into_tensor(output_tensor, input_tensor, group, async_op)


def all_gather_coalesced(output_tensors, input_tensors, group=None, async_op=False):
    for out, t in zip(output_tensors, input_tensors):
        all_gather_into_tensor(out, t, group)
    return _work(None, async_op)


def reduce_scatter_tensor(output_tensor, input_tensor, op=ReduceOp.SUM, group=None,
                          async_op=False):
    name = _op(op, "reduce_scatter_tensor")
    if name not in ("sum", "avg"):
        raise ConfigError(f"deepspeed.comm.reduce_scatter_tensor: op {op!r} is not supported "
                          "here: use ReduceOp.SUM or AVG")
    overlap = async_op and name == "sum"  # AVG divides after the sum: it waits for it
    work = _comm().reduce_scatter(output_tensor, input_tensor, group=group, async_op=overlap)
    if name == "avg":
        output_tensor.div_(get_world_size(group))
    return _work(work, async_op)


def reduce_scatter_fn(output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op=False,
                      prof=False, debug=None):
    return reduce_scatter_tensor(output_tensor, tensor, op, group, async_op)


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    return reduce_scatter_tensor(output, torch.cat([t.reshape(-1) for t in input_list]),
                                 op, group, async_op)


def all_gather_object(object_list, obj, group=None):
    _world_only("all_gather_object", group)
    object_list[:] = _comm().gather_objects(obj)


def broadcast_object_list(object_list, src, group=None, device=None):
    _world_only("broadcast_object_list", group)
    object_list[:] = _comm().gather_objects(list(object_list))[src]


# -- point to point -------------------------------------------------------------------------------
def send(tensor, dst, group=None, tag=0):
    _comm().send(tensor, dst, group=group)


def recv(tensor, src=None, group=None, tag=0):
    if src is None:
        raise ConfigError("deepspeed.comm.recv(src=None) (from any rank) is not supported: name "
                          "the sending rank")
    _comm().recv(tensor, src, group=group)
    return src


def isend(tensor, dst, group=None, tag=0):
    return _comm().batch_isend_irecv([(tensor, dst)], [], group)[0]


def irecv(tensor, src=None, group=None, tag=0):
    if src is None:
        raise ConfigError("deepspeed.comm.irecv(src=None) is not supported: name the sending "
                          "rank")
    return _comm().batch_isend_irecv([], [(tensor, src)], group)[0]


class P2POp:
    """One operation of batch_isend_irecv: `op` is isend or irecv."""

    def __init__(self, op, tensor, peer, group=None, tag=0):
        if getattr(op, "__name__", None) not in ("isend", "irecv"):
            raise ConfigError(f"deepspeed.comm.P2POp: op {op!r} must be isend or irecv")
        self.op, self.tensor, self.peer, self.group, self.tag = op, tensor, peer, group, tag


def batch_isend_irecv(p2p_op_list):
    groups = {id(o.group) for o in p2p_op_list}
    if len(groups) > 1:
        raise ConfigError("deepspeed.comm.batch_isend_irecv: every P2POp of a batch must name "
                          "the same group")
    sends = [(o.tensor, o.peer) for o in p2p_op_list if o.op.__name__ == "isend"]
    recvs = [(o.tensor, o.peer) for o in p2p_op_list if o.op.__name__ == "irecv"]
    return _comm().batch_isend_irecv(sends, recvs, p2p_op_list[0].group if p2p_op_list else None)


def has_all_gather_into_tensor() -> bool:
    return True


def has_reduce_scatter_tensor() -> bool:
    return True


def has_all_reduce_coalesced() -> bool:
    return True


def has_coalescing_manager() -> bool:
    return False


# -- refused: name -> what to use instead ---------------------------------------------------------
LOGGER = ("DeepSpeed's communication logger is not in this drop-in: time the engine's "
          "communication with the DeepSpeed config's wall_clock_breakdown (or --wall-clock-"
          "breakdown)")
LAUNCHER = ("init_distributed() reads the launcher's variables (torchrun, deepspeed, srun, "
            "mpirun): launch with one of them")
REFUSED = {
    **{name: LOGGER for name in (
        "configure", "log_summary", "reset_log", "has_comm_data", "get_comm_operation_count",
        "get_logged_comm_ops", "timed_op", "get_debug_log_name", "get_default_args",
        "get_msg_size_from_args", "get_tensor_kwarg", "get_tensor_position")},
    **{name: LAUNCHER for name in ("mpi_discovery", "in_aml", "in_aws_sm", "in_dlts",
                                   "patch_aml_env_for_torch_nccl_backend",
                                   "patch_aws_sm_env_for_torch_nccl_backend")},
    "set_backend": "the backend is init_distributed(dist_backend=...)'s (nccl on GPUs, gloo on "
                   "CPUs)",
    "init_deepspeed_backend": "the backend is init_distributed(dist_backend=...)'s",
    "TorchBackend": "use deepspeed.comm's functions (they run on torch.distributed)",
    "CCLBackend": "use deepspeed.comm's functions with dist_backend gloo or nccl (no oneCCL)",
    "ProcessGroup": "use new_group(ranks), or the engine's groups (engine.grid / mpu)",
    "scatter": "use broadcast (every rank receives the whole tensor) and take its part",
    "all_to_all": "no all-to-all here (MoE and Ulysses only): use all_gather",
    "all_to_all_single": "no all-to-all here (MoE and Ulysses only): use all_gather_into_tensor",
    "initialize_mesh_device": "the engine's process grid holds the groups: engine.grid / mpu",
    "enable_symm_mem_for_group": "symmetric memory is not used here: drop the call",
}


def _refusal(name: str, instead: str):
    def refused(*args, **kwargs):
        raise ConfigError(f"deepspeed.comm.{name} is not in the megatron_2bw drop-in: {instead}")
    refused.__name__ = refused.__qualname__ = name
    if name[:1].isupper():  # a class of DeepSpeed's: refused when constructed
        return type(name, (), {"__init__": lambda self, *a, **k: refused()})
    return refused


globals().update({name: _refusal(name, instead) for name, instead in REFUSED.items()})

__all__ = sorted(n for n in globals() if not n.startswith("_") and n not in (
    "annotations", "torch", "Comm", "ConfigError", "env_rank_world", "LOGGER",
    "LAUNCHER", "REFUSED"))
