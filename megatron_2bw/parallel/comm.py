"""The package's one door to torch.distributed: every collective and point-to-point call goes
through a `Comm`, which knows the device its backend communicates on and refuses any other.

    backend   tensors must be on
    nccl      cuda:<local rank>   the rank's own GPU (never "cuda", which is whatever is current)
    gloo      cpu
    (none)    no process group: a world of one; value calls return at once

Tensor calls (all_reduce, broadcast, all_gather, reduce_scatter, all_gather_into, send, recv,
batch_isend_irecv) check every
tensor against `comm.device` and raise `CommDeviceError` (one line: the call, the tensor's device,
the device wanted, the fix) before torch sees it. NCCL itself rejects a CPU tensor only on a GPU
cluster; this check makes the same mistake fail on a CPU-only machine as soon as the device a
careless tensor lands on differs from the backend's (tests/distributed/test_comm_device_rule.py).

Value calls (barrier, gather_objects, reduce_floats, gather_floats) take Python values and build
their tensors on `comm.device` themselves, so callers never create a tensor for a collective.

Groups are torch group handles created by `new_group` (the ProcessGrid owns them); `group=None`
is the world. Reduce ops are named: "sum" or "max".
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_2bw.parallel.devices import backend_device, is_initialized
from megatron_2bw.parallel.launcher import env_rank_world

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
# single-tensor reduce-scatter / all-gather under their newest names (older torch: *_tensor)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CommDeviceError(ValueError):
    """A tensor handed to a collective on another device than the backend communicates on."""


class Comm:
    """Collectives and point-to-point of one rank, on `device` (see the module docstring).

    `Comm()` resolves its backend and device from the process group when first used (the device
    from the launcher's local rank, not from whatever CUDA device happens to be current);
    `Comm(device, backend)` states them (start_process_group does)."""

    def __init__(self, device=None, backend: str | None = None):
        self._device = torch.device(device) if device is not None else None
        self._backend = backend

    # -- identity -------------------------------------------------------------------------------
    @property
    def distributed(self) -> bool:
        return is_initialized()

    @property
    def backend(self) -> str | None:
        if self._backend is None and self.distributed:
            self._backend = dist.get_backend()
        return self._backend

    @property
    def device(self) -> torch.device:
        if self._device is None:
            if not self.distributed:
                return torch.device("cpu")  # nothing to communicate with; not cached
            self._device = backend_device(self.backend, env_rank_world()[2])
        return self._device

    @property
    def rank(self) -> int:
        return dist.get_rank() if self.distributed else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if self.distributed else 1

    def __repr__(self) -> str:
        return f"Comm(device={self._device}, backend={self._backend})"

    # -- the device rule ------------------------------------------------------------------------
    def check(self, tensor: torch.Tensor, call: str) -> torch.Tensor:
        """`tensor` if it is on `device`, else a one-line CommDeviceError naming the call."""
        if tensor.device != self.device:
            raise CommDeviceError(
                f"{call}: tensor on {tensor.device}, but the {self.backend or 'local'} backend "
                f"of rank {self.rank} communicates on {self.device}: create it with "
                "device=comm.device (or move it with .to(comm.device)) before the collective")
        return tensor

    def expect_device(self, device, who: str) -> None:
        """One-line error when a component computes on another device than the backend's."""
        if self.distributed and torch.device(device) != self.device:
            raise CommDeviceError(f"{who} runs on {torch.device(device)}, but the {self.backend} "
                                  f"backend of rank {self.rank} communicates on {self.device}: "
                                  "pass device=grid.comm.device")

    # -- tensor collectives ---------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, group=None, op: str = "sum",
                   async_op: bool = False):
        self.check(tensor, "all_reduce")
        return dist.all_reduce(tensor, op=_OPS[op], group=group, async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, group=None):
        """`src` is a global rank."""
        self.check(tensor, "broadcast")
        return dist.broadcast(tensor, src=src, group=group)

    def all_gather(self, parts: list[torch.Tensor], tensor: torch.Tensor, group=None):
        for t in [tensor, *parts]:
            self.check(t, "all_gather")
        return dist.all_gather(parts, tensor, group=group)

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor, group=None,
                       async_op: bool = False):
        """Sum `tensor` (k equal chunks, k = the group's size) over the group; this rank's chunk of
        the sum lands in `output`, which may be that chunk of `tensor` itself (in place)."""
        self.check(output, "reduce_scatter")
        self.check(tensor, "reduce_scatter")
        return _REDUCE_SCATTER(output, tensor, op=_OPS["sum"], group=group, async_op=async_op)

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor, group=None,
                        async_op: bool = False):
        """Every rank's `tensor` concatenated, in group-rank order, into `output` (k times its
        size); `tensor` may be this rank's chunk of `output` itself (in place)."""
        self.check(output, "all_gather_into")
        self.check(tensor, "all_gather_into")
        return _ALL_GATHER(output, tensor, group=group, async_op=async_op)

    def send(self, tensor: torch.Tensor, peer: int, group=None) -> None:
        """Blocking send to global rank `peer` (within `group` when given)."""
        dist.send(self.check(tensor, "send"), peer, group=group)

    def recv(self, tensor: torch.Tensor, peer: int, group=None) -> None:
        dist.recv(self.check(tensor, "recv"), peer, group=group)

    def batch_isend_irecv(self, sends: list[tuple[torch.Tensor, int]],
                          recvs: list[tuple[torch.Tensor, int]], group=None) -> list:
        """Post (tensor, global peer rank) sends and receives as one batch on `group`; returns
        the works to wait on. All peers must belong to `group`."""
        ops = [dist.P2POp(dist.isend, self.check(t, "isend"), peer, group) for t, peer in sends]
        ops += [dist.P2POp(dist.irecv, self.check(t, "irecv"), peer, group) for t, peer in recvs]
        return dist.batch_isend_irecv(ops) if ops else []

    # -- value collectives (over the world unless a group is given) ----------------------------
    def barrier(self) -> None:
        if not self.distributed or self.world_size == 1:
            return
        if self.device.type == "cuda":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def gather_objects(self, obj) -> list:
        """Every rank's `obj` (picklable), in rank order, on every rank."""
        if not self.distributed or self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def reduce_floats(self, values: list[float], op: str = "sum", group=None) -> list[float]:
        """Element-wise sum or max of `values` over the world (or `group`), in float64, through
        a tensor this call creates on `device`; a host sync, so not for the per-batch path."""
        if not self.distributed or self.world_size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        self.all_reduce(t, group=group, op=op)
        return t.cpu().tolist()

    def gather_floats(self, values: list[float]) -> list[list[float]]:
        """Every rank's `values` (the same length everywhere), in rank order, on every rank: one
        all-gather of a float64 tensor this call creates on `device`; a host sync, so for log
        intervals, not the per-batch path."""
        if not self.distributed or self.world_size == 1:
            return [list(values)]
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        self.all_gather(parts, t)
        return torch.stack(parts).cpu().tolist()

    # -- groups ---------------------------------------------------------------------------------
    def new_group(self, ranks: list[int]):
        """Collective over the world: every rank calls it for every group, in the same order."""
        return dist.new_group(ranks)
