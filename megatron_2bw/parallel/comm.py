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

Groups are torch group handles created by `split` (one call per kind of group, see its docstring;
the ProcessGrid owns them) or `new_group`, each with the Comm's timeout (the user's
--distributed-timeout-minutes, which the world group got from init_process_group); `group=None`
is the world. Reduce ops are named: "sum" or "max".

A peer that stops answering (frozen, dead, its connection closed) surfaces as `PeerError`: one
line naming the rank(s) waited for, what was waited on and the fix (`peer_error`); the blocking
calls here raise it themselves, and the engine's waits on async works build it the same way.
"""
from __future__ import annotations

import datetime
import re

import torch
import torch.distributed as dist

from megatron_2bw.config.launcher_env import env_rank_world
from megatron_2bw.parallel.devices import backend_device, is_initialized

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
# single-tensor reduce-scatter / all-gather under their newest names (older torch: *_tensor)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# the timeout the world group started with (distributed.init_process_group records it here; the
# process group itself is process-wide state in torch): a Comm() that states none inherits it
WORLD_TIMEOUT = {"minutes": None}


class CommDeviceError(ValueError):
    """A tensor handed to a collective on another device than the backend communicates on."""


class PeerError(RuntimeError):
    """A collective or point-to-point operation whose peer never answered (the timeout passed)
    or went away (its connection closed). The message is one line that names the peer; the cause
    is on that rank, so a launcher prints it without this rank's traceback."""


# what gloo and NCCL say when a peer times out or goes away (not: a shape or dtype mismatch)
_TIMEOUT_WORDS = ("timed out", "timeout")
_GONE_WORDS = ("connection closed", "connection reset", "broken pipe", "pair closure",
               "connection refused", "socket closed", "end of file", "nccl error",
               "communicator was aborted")


def is_peer_failure(e: BaseException) -> bool:
    """Whether `e` says a peer timed out or went away (not a bug of this rank's call)."""
    if isinstance(e, PeerError):
        return True
    backend_error = getattr(dist, "DistBackendError", ())
    network_error = getattr(dist, "DistNetworkError", ())
    if isinstance(e, (backend_error, network_error)):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(w in text for w in _TIMEOUT_WORDS + _GONE_WORDS)


def peer_error(e: BaseException, waited_for: str, what: str,
               timeout_s: float | None) -> PeerError:
    """The one-line PeerError for `e` (raised while waiting for `waited_for`, e.g. "rank 1
    (stage 1/2)", on `what`, e.g. "activation receive")."""
    first = str(e).splitlines()[0].strip() if str(e) else type(e).__name__
    first = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". ")[0]  # no "[file.cc:N] ", no advice
    if any(w in first.lower() for w in _TIMEOUT_WORDS):
        after = f" after {timeout_s:g} s" if timeout_s else ""
        return PeerError(f"timed out{after} waiting for {waited_for} on the {what}: it may be "
                         "frozen or dead; raise --distributed-timeout-minutes if it is only slow "
                         "(a long checkpoint save or data-index build)")
    return PeerError(f"lost {waited_for} during the {what}: that rank died or closed its "
                     f"connection ({first}); its own error line, if it printed one, names the "
                     "cause")


def describe_ranks(others: list[int], one=str) -> str:
    """"rank 1", "one of ranks 1, 3" (a few, each as `one` names it) or "one of the 7 other
    ranks (0, 2, ... 7)": the ranks an error line says a rank waited for."""
    if len(others) == 1:
        return f"rank {one(others[0])}"
    if len(others) <= 4:
        return "one of ranks " + ", ".join(map(one, others))
    return f"one of the {len(others)} other ranks ({others[0]}, {others[1]}, ... {others[-1]})"


class Comm:
    """Collectives and point-to-point of one rank, on `device` (see the module docstring).

    `Comm()` resolves its backend and device from the process group when first used (the device
    from the launcher's local rank, not from whatever CUDA device happens to be current);
    `Comm(device, backend, timeout_minutes)` states them (start_process_group does); every
    group it creates gets `timeout_minutes` (None: the world group's, WORLD_TIMEOUT, as the
    process group started with it; torch's default without one)."""

    def __init__(self, device=None, backend: str | None = None,
                 timeout_minutes: float | None = None):
        self._device = torch.device(device) if device is not None else None
        self._backend = backend
        self._timeout_minutes = timeout_minutes

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

    @property
    def timeout_minutes(self) -> float | None:
        if self._timeout_minutes is None and self.distributed:
            return WORLD_TIMEOUT["minutes"]
        return self._timeout_minutes

    @property
    def timeout(self) -> datetime.timedelta | None:
        """The timeout of every group this Comm creates (None: torch's default)."""
        if self.timeout_minutes is None:
            return None
        return datetime.timedelta(minutes=self.timeout_minutes)

    @property
    def timeout_s(self) -> float | None:
        return None if self.timeout_minutes is None else round(self.timeout_minutes * 60, 1)

    def __repr__(self) -> str:
        return (f"Comm(device={self._device}, backend={self._backend}, "
                f"timeout_minutes={self._timeout_minutes})")

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
        return self._guard("all-reduce", group, lambda: dist.all_reduce(
            tensor, op=_OPS[op], group=group, async_op=async_op))

    def broadcast(self, tensor: torch.Tensor, src: int, group=None):
        """`src` is a global rank."""
        self.check(tensor, "broadcast")
        return self._guard("broadcast", group, lambda: dist.broadcast(tensor, src=src,
                                                                      group=group))

    def all_gather(self, parts: list[torch.Tensor], tensor: torch.Tensor, group=None):
        for t in [tensor, *parts]:
            self.check(t, "all_gather")
        return self._guard("all-gather", group, lambda: dist.all_gather(parts, tensor,
                                                                        group=group))

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor, group=None,
                       async_op: bool = False):
        """Sum `tensor` (k equal chunks, k = the group's size) over the group; this rank's chunk of
        the sum lands in `output`, which may be that chunk of `tensor` itself (in place)."""
        self.check(output, "reduce_scatter")
        self.check(tensor, "reduce_scatter")
        return self._guard("reduce-scatter", group, lambda: _REDUCE_SCATTER(
            output, tensor, op=_OPS["sum"], group=group, async_op=async_op))

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor, group=None,
                        async_op: bool = False):
        """Every rank's `tensor` concatenated, in group-rank order, into `output` (k times its
        size); `tensor` may be this rank's chunk of `output` itself (in place)."""
        self.check(output, "all_gather_into")
        self.check(tensor, "all_gather_into")
        return self._guard("all-gather", group, lambda: _ALL_GATHER(
            output, tensor, group=group, async_op=async_op))

    def send(self, tensor: torch.Tensor, peer: int, group=None) -> None:
        """Blocking send to global rank `peer` (within `group` when given)."""
        self.check(tensor, "send")
        self._guard("send", group, lambda: dist.send(tensor, peer, group=group), peer)

    def recv(self, tensor: torch.Tensor, peer: int, group=None) -> None:
        self.check(tensor, "recv")
        self._guard("receive", group, lambda: dist.recv(tensor, peer, group=group), peer)

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
            self._guard("barrier", None, lambda: dist.barrier(device_ids=[self.device.index]))
        else:
            self._guard("barrier", None, dist.barrier)

    def gather_objects(self, obj) -> list:
        """Every rank's `obj` (picklable), in rank order, on every rank."""
        if not self.distributed or self.world_size == 1:
            return [obj]
        out = [None] * self.world_size
        self._guard("all-gather of objects", None, lambda: dist.all_gather_object(out, obj))
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

    # -- peers that stop answering ---------------------------------------------------------------
    def _guard(self, what: str, group, call, peer: int | None = None):
        """`call()`, with a peer's timeout or death turned into a one-line PeerError."""
        try:
            return call()
        except RuntimeError as e:
            if isinstance(e, PeerError) or not is_peer_failure(e):
                raise
            ranks = [peer] if peer is not None else list(dist.get_process_group_ranks(group)) \
                if group is not None else list(range(self.world_size))
            raise peer_error(e, self.name_ranks(ranks), f"{what} ({self.group_name(group)})",
                             self.timeout_s) from e

    def name_ranks(self, ranks: list[int]) -> str:
        """`ranks` other than this one, for an error line ("rank 1", "one of ranks 1, 3"); the
        grid replaces it with its own, which adds each rank's coordinates (init_groups)."""
        return describe_ranks([r for r in ranks if r != self.rank])

    @staticmethod
    def group_name(group) -> str:
        if group is None:
            return "the world group"
        desc = getattr(group, "group_desc", None)
        return f"group {desc}" if desc and desc != "undefined" else "its group"

    # -- groups ---------------------------------------------------------------------------------
    def group_ranks(self, group=None) -> list[int]:
        """The global ranks of `group` (None: the world), in group-rank order."""
        if group is None or not self.distributed:
            return list(range(self.world_size))
        return list(dist.get_process_group_ranks(group))

    @property
    def world_group(self):
        """The world's group handle (every call here also takes None for it)."""
        return dist.group.WORLD if self.distributed else None

    @property
    def can_split(self) -> bool:
        """Whether groups come from splitting the world's communicator (`dist.split_group`: one
        ncclCommSplit per call): NCCL with the world group bound to this rank's GPU
        (start_process_group binds it). gloo, torch's fake backend and the rest cannot split."""
        world = dist.group.WORLD if self.distributed else None
        return (self.backend == "nccl" and world is not None
                and getattr(world, "bound_device_id", None) is not None
                and hasattr(dist, "split_group"))

    def split(self, groups: list[list[int]], desc: str, mine: int | None):
        """This rank's group, `groups[mine]`, among the disjoint `groups` (global ranks; `mine`
        None: in none, and it gets None), every group with the Comm's timeout and described as
        `desc` (NCCL's watchdog names it). Collective over the world: every rank makes the
        same calls in one order.

        Where the backend can split (`can_split`) it is one world-wide call, one ncclCommSplit.
        Elsewhere (gloo, the fake backend) it falls back to one `new_group` per group: every
        rank makes each call, but a rank outside a group only counts it (torch creates and
        connects nothing there), so the fall-back costs non-members no communication."""
        if self.can_split:
            return dist.split_group(split_ranks=groups, timeout=self.timeout, group_desc=desc)
        created = [self.new_group(ranks, desc) for ranks in groups]
        return None if mine is None else created[mine]

    def new_group(self, ranks: list[int], desc: str | None = None):
        """Collective over the world: every rank calls it for every group, in the same order.
        The group gets the Comm's timeout (torch's default would be 10 min on NCCL, 30 on
        gloo, whatever --distributed-timeout-minutes says)."""
        return dist.new_group(ranks, timeout=self.timeout, group_desc=desc)
