"""Point-to-point between neighbouring stages, overlapped with compute, on the pipeline's groups.

Groups. Each neighbour is reached through the group of that pair of stages
(`ProcessGrid.pair_group`), never the world group, so no batched send needs (or, under NCCL,
lazily initializes a communicator over) ranks outside the pair. Under NCCL, where one
communicator runs its operations in posting order on one stream, the pair has one group per
direction (activations s -> s+1, gradients s+1 -> s), so a receive posted early never holds back
a send to the same neighbour; gloo matches each direction's messages on its own and needs one.

Overlap (the engine drives it; `pipeline/engine.py`):

    post_recv(key, buffers, peer)   post a receive now (it may be long before it is needed)
    wait_recv(key)                  right before the forward / backward that consumes it
    send(tensors, peer)             post sends; they complete in the background
    wait_sends(keep)                wait for all but the `keep` newest send posts
    drain()                         wait for everything (the end of a window)

Why this cannot deadlock when the schedule's table is valid (`simulate.check_schedule`): the
validator proves the table deadlock-free when every communication group waits for all of its
operations before the stage moves on. Here every operation is posted in the table's order per
peer and direction (FIFO matching pairs the same messages), no later than the table posts it, and
waited for no earlier than the table waits for it. Posting a receive early only lets its sender
finish sooner (gloo: unordered across directions; NCCL: alone on its direction's stream), and
waiting later only lets this stage move sooner, so every stage is at least as far along as in
the validated execution. Under NCCL's stricter rules (one in-order stream per communicator, a
waiting rank posting nothing more) `schedule/nccl_order.py` replays what every rank posts, these
collectives included, and the engine posts receives early only where it proved that safe.
Tests: tests/distributed/test_p2p_overlap.py (d = 4 and 8, every schedule),
tests/unit/test_nccl_order.py.

Buffers. Received tensors land in buffers from a pool keyed by (shapes, dtypes): after the first
batches no receive allocates. The engine returns a buffer with `release` once its consumer is done
(an activation after its backward, a gradient after the backward it feeds); a released buffer is
handed out again only when no send still in flight shares its storage (a stage whose output
aliases its input sends the very buffer it received).

Shapes. A shape/dtype handshake at the start of every run (`ensure_meta_sent` /
`ensure_meta_received`, a blocking send/recv on the activation direction before the first
activation) lets receivers allocate buffers. After that a receiver posts every activation receive
with the last shapes its sender announced, so a sender whose output changes must say so without
an extra message on the unchanged path and before the receiver posts anything sized by the old
shapes. The engine names "header" microbatches (schedule.actions.SHAPE_MODES: none for the
pretrain scripts, whose batches all have one shape; the first of every batch after the run's
first, DeepSpeed's default; every microbatch under `dynamic_shape`): their first tensor travels
with a tail of META_LEN int64
(the sender's current shapes) in the same message, both sides knowing from the schedule alone
which messages have it. While a header receive is unchecked nothing later is posted on that
direction (`unverified`); the receiver checks the tail right before the forward (`verify`, the
one host read per batch). Unchanged: the message was the data. Changed: that message, sized by
the old shapes, was a notice, and the data follows in the new shapes in the same post; the
receiver posts it and waits (the only extra message, and only when the shape changes; the sender
posted both together, so that wait needs nothing more from it and adds no cycle). Gradients
need nothing: a stage receives them with the shapes of its own outputs. A change at a microbatch
without a header (within a batch, no `dynamic_shape`) cannot be announced: the sender refuses it
in one line (`ShapeChangeError`) before posting anything, and its neighbours exit on its exit.
"""
from __future__ import annotations

import torch

from megatron_2bw.config import ConfigError

META_LEN = 64
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool]


def encode_meta(tensors: tuple[torch.Tensor, ...], device) -> torch.Tensor:
    """[count, (dtype code, requires_grad, ndim, *shape) per tensor], zero padded."""
    values = [len(tensors)]
    for t in tensors:
        values += [_DTYPES.index(t.dtype), int(t.requires_grad), t.dim(), *t.shape]
    if len(values) > META_LEN:
        raise ValueError(f"stage output too complex to describe in {META_LEN} integers: "
                         f"{[tuple(t.shape) for t in tensors]}")
    meta = torch.zeros(META_LEN, dtype=torch.int64, device=device)
    meta[:len(values)] = torch.tensor(values, dtype=torch.int64, device=device)
    return meta


def decode_meta(meta: torch.Tensor) -> list[tuple[torch.Size, torch.dtype, bool]]:
    v = meta.tolist()
    out, i = [], 1
    for _ in range(v[0]):
        dtype, req, ndim = _DTYPES[v[i]], bool(v[i + 1]), v[i + 2]
        out.append((torch.Size(v[i + 3:i + 3 + ndim]), dtype, req))
        i += 3 + ndim
    return out


class ShapeChangeError(ConfigError):
    """A change of a stage's output that its receiver cannot be told about: one line naming the
    setting that allows it (a ConfigError: the entry points print it without a traceback)."""


def signature(tensors) -> list:
    """What the handshake and the headers describe: [(shape, dtype, requires_grad)] per tensor
    (`decode_meta`'s form)."""
    return [(t.shape, t.dtype, t.requires_grad) for t in tensors]


def _tail(dtype: torch.dtype) -> int:
    """Elements of `dtype` a header's META_LEN int64 take at the end of a first tensor."""
    return META_LEN * 8 // torch.empty((), dtype=dtype).element_size()


def with_header(t: torch.Tensor, header: torch.Tensor) -> torch.Tensor:
    """`t` flattened, followed by `header`'s bytes (a copy: once per batch)."""
    n = t.numel()
    flat = torch.empty(n + _tail(t.dtype), dtype=t.dtype, device=t.device)
    flat[:n].copy_(t.reshape(-1))
    flat[n:].view(torch.uint8).copy_(header.view(torch.uint8))
    return flat


def read_header(flat: torch.Tensor, n: int) -> list:
    """The shapes a header carries (`decode_meta`'s form) after the first `n` elements of `flat`
    (a host read)."""
    raw = flat[n:].view(torch.uint8).to("cpu", copy=True).view(torch.int64)
    v, i = raw.tolist(), 1
    ok = 1 <= v[0] <= META_LEN // 3
    for _ in range(v[0] if ok else 0):
        end = i + 3 + v[i + 2] if i + 3 <= META_LEN and 0 <= v[i + 2] <= META_LEN else -1
        ok = 0 < end <= META_LEN and 0 <= v[i] < len(_DTYPES) and v[i + 1] in (0, 1) \
            and min(v[i + 3:end], default=0) >= 0
        if not ok:
            break
        i = end
    if not ok:
        raise ShapeChangeError(f"the previous stage sent an activation header that is not one "
                               f"({v[:8]}...): both stages must run the same megatron_2bw")
    return decode_meta(raw)


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


class P2P:
    def __init__(self, grid, device):
        self.prev, self.next, self.device = grid.prev_rank, grid.next_rank, torch.device(device)
        self.comm, self.grid = grid.comm, grid
        self._free: dict[tuple, list[tuple]] = {}   # signature -> released buffer tuples
        self._sends: list[tuple] = []               # (works, tensors, peers) per post, oldest first
        self.pending: dict = {}                     # receive key -> (works, peer)
        self.reset()

    def reset(self) -> None:
        """Start of a run (training segment or evaluation): the handshake happens again."""
        self.sent_meta: list | None = None  # what the next stage expects (signature's form)
        self._header = None                 # encode_meta of sent_meta (made once per change)
        self.recv_meta: list | None = None
        self.unverified = None              # the key of a header receive not checked yet

    @property
    def shape_state(self) -> tuple:
        """What `reset` clears (saved around an evaluation by the engine)."""
        return self.sent_meta, self._header, self.recv_meta, self.unverified

    @shape_state.setter
    def shape_state(self, state: tuple) -> None:
        self.sent_meta, self._header, self.recv_meta, self.unverified = state

    # -- handshake and headers --------------------------------------------------------------------
    def ensure_meta_sent(self, tensors: tuple[torch.Tensor, ...]) -> None:
        if self.sent_meta is None:
            self.comm.send(encode_meta(tensors, self.device), self.next,
                           self._group(self.next, gradients=False))
            self.sent_meta = signature(tensors)

    def activation_sends(self, tensors: tuple, outputs: tuple, header: bool, mb: int) -> list:
        """The tensors that carry activation `tensors` (of graph `outputs`) to the next stage:
        after the handshake the same ones; on a `header` microbatch the first with its tail, or,
        if the shapes changed, a notice in the old shapes and then the tensors themselves."""
        self.ensure_meta_sent(outputs)
        sig = signature(outputs)
        if sig == self.sent_meta:
            if not header:
                return [t.contiguous() for t in tensors]
            if self._header is None:
                self._header = encode_meta(outputs, self.device)
            return [with_header(tensors[0], self._header)] + [t.contiguous() for t in tensors[1:]]
        if not header:
            raise ShapeChangeError(
                f"stage output of microbatch {mb} changed within a batch, "
                f"{[tuple(s) for s, _, _ in self.sent_meta]} -> {[tuple(t.shape) for t in outputs]}"
                ": keep shapes constant within a batch, or pass dynamic_shape=True "
                "(PipelineModule / PipelineEngine) to announce a change at every microbatch")
        self._header = encode_meta(outputs, self.device)
        old = [torch.empty(s, dtype=d, device=self.device) for s, d, _ in self.sent_meta]
        self.sent_meta = sig
        self._free.clear()  # buffers of the old shapes
        notice = [with_header(old[0], self._header)] + old[1:]
        return notice + [t.contiguous() for t in tensors]

    def ensure_meta_received(self) -> list:
        if self.recv_meta is None:
            meta = torch.empty(META_LEN, dtype=torch.int64, device=self.device)
            self.comm.recv(meta, self.prev, self._group(self.prev, gradients=False))
            self.recv_meta = decode_meta(meta)
        return self.recv_meta

    def _group(self, peer: int, gradients: bool):
        """The pair group with `peer` of the direction activations (to the next stage) or
        gradients (to the previous stage) flow in (one group serves both under gloo)."""
        return self.grid.pair_group(peer, gradients=gradients)

    # -- buffers ----------------------------------------------------------------------------------
    def activation_buffers(self) -> tuple[torch.Tensor, ...]:
        """Buffers for one activation as the handshake described it (requires_grad off until the
        engine sets it after the receive)."""
        return self._acquire(tuple((s, d) for s, d, _ in self.recv_meta))

    def post_header_recv(self, key, peer: int) -> tuple[torch.Tensor, ...]:
        """Post the receive of a header microbatch (the first tensor with its tail); returns the
        activation's buffers (the first a view). `verify(key, ...)` waits for it."""
        (s0, d0, _), rest = self.recv_meta[0], self.recv_meta[1:]
        n = s0.numel()
        posted = self._acquire((((n + _tail(d0),), d0),) + tuple((s, d) for s, d, _ in rest))
        self.unverified = key
        self.post_recv(key, posted, peer)
        return (posted[0][:n].view(s0),) + posted[1:]  # (a view: `release` pools its base)

    def verify(self, key, bufs: tuple) -> tuple:
        """Wait for header receive `key` (posted into `bufs`) and check its shapes: the same,
        `bufs`; changed, the receive of the data in the new shapes (posted and waited here)."""
        self.unverified = None
        self.wait_recv(key)
        first = bufs[0]
        meta = read_header(first._base if first._base is not None else first, first.numel())
        if meta == self.recv_meta:
            return bufs
        self.recv_meta = meta
        self._free.clear()  # buffers of the old shapes
        bufs = self.activation_buffers()
        self.post_recv(key, bufs, self.prev)
        self.wait_recv(key)
        return bufs

    def gradient_buffers(self, like: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Buffers for the gradients of `like` (this stage's outputs that require grad)."""
        return self._acquire(tuple((t.shape, t.dtype) for t in like))

    def _acquire(self, signature: tuple) -> tuple[torch.Tensor, ...]:
        free = self._free.get(signature)
        if free:
            busy = {_storage(t) for _, tensors, _ in self._sends for t in tensors}
            for i in range(len(free) - 1, -1, -1):
                if not busy.intersection(_storage(t) for t in free[i]):
                    return free.pop(i)
        return tuple(torch.empty(s, dtype=d, device=self.device) for s, d in signature)

    def release(self, buffers: tuple[torch.Tensor, ...]) -> None:
        """Give `buffers` back to the pool: their consumer is done with them."""
        for t in buffers:
            t.grad = None
            t.requires_grad_(False)
        if buffers and buffers[0]._base is not None:  # a header receive's (post_header_recv)
            buffers = (buffers[0]._base,) + tuple(buffers[1:])
        key = tuple((t.shape, t.dtype) for t in buffers)
        self._free.setdefault(key, []).append(buffers)

    # -- posting and waiting ----------------------------------------------------------------------
    def post_recv(self, key, buffers: tuple[torch.Tensor, ...], peer: int) -> None:
        """Post the receive of `buffers` from `peer` now; `wait_recv(key)` before using them."""
        self.pending[key] = (self._post([], [(t, peer) for t in buffers], peer), peer)

    def arrived(self, key) -> bool:
        """Whether the receive `key` has completed (no wait; a failed one counts as arrived:
        `wait_recv` reports it)."""
        works, _ = self.pending[key]
        try:
            return all(w.is_completed() for w in works)
        except RuntimeError:
            return True

    def wait_recv(self, key) -> None:
        works, peer = self.pending.pop(key)
        self._wait(works, [peer], receiving=True)

    def send(self, sends: list[tuple[torch.Tensor, int]]) -> None:
        """Post (tensor, peer) sends, one batch per peer; they complete in the background."""
        peers = sorted({peer for _, peer in sends})
        works = [w for peer in peers for w in self._post([(t, p) for t, p in sends if p == peer],
                                                         [], peer)]
        if works:
            self._sends.append((works, [t for t, _ in sends], peers))

    def wait_sends(self, keep: int = 0) -> None:
        """Wait for the sends of all but the `keep` newest `send` calls."""
        while len(self._sends) > keep:
            works, _, peers = self._sends[0]
            self._wait(works, peers, receiving=False)
            self._sends.pop(0)

    def drain(self) -> None:
        """Wait for every posted operation (nothing is in flight afterwards)."""
        for key in list(self.pending):
            self.wait_recv(key)
        self.wait_sends()

    @property
    def idle(self) -> bool:
        return not self.pending and not self._sends

    def _post(self, sends: list, recvs: list, peer: int) -> list:
        """Sends to `peer` or receives from it (never both: under NCCL they are two groups):
        activations go to the next stage, gradients to the previous one."""
        gradients = peer == (self.prev if sends else self.next)
        try:
            return self.comm.batch_isend_irecv(sends, recvs, self._group(peer, gradients))
        except RuntimeError as e:
            self._fail(e, [peer], receiving=bool(recvs))

    def _wait(self, works: list, peers: list, receiving: bool) -> None:
        try:
            for work in works:
                work.wait()
        except RuntimeError as e:
            self._fail(e, peers, receiving)

    def _fail(self, e: RuntimeError, peers: list, receiving: bool):
        """One line naming the neighbour(s) and the exchange (a PeerError: no traceback)."""
        gradients = (peers[0] == self.next) if receiving else (peers[0] == self.prev)
        what = (f"{'gradient' if gradients else 'activation'} "
                f"{'receive' if receiving else 'send'} (point-to-point on the stage pair)")
        raise self.grid.peer_error(e, what, ranks=peers) from e
