"""Point-to-point between neighbouring stages, on the pipeline's own groups: each neighbour is
reached through the two-rank group of that pair of stages (ProcessGrid.pair_group), never the
world group, so no batched send needs (or, under NCCL, lazily initializes a communicator over)
ranks outside the pair. One communication action group of the schedule becomes one batched
isend/irecv per neighbour; all of them are posted before any is waited on. A one-time
shape/dtype handshake per run lets receivers allocate buffers."""
from __future__ import annotations

import torch

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


class P2P:
    def __init__(self, grid, device):
        self.prev, self.next, self.device = grid.prev_rank, grid.next_rank, torch.device(device)
        self.comm, self.grid = grid.comm, grid
        self.reset()

    def reset(self) -> None:
        """Start of a run (training segment or evaluation): the handshake happens again."""
        self.meta_sent = False
        self.recv_meta: list | None = None

    def ensure_meta_sent(self, tensors: tuple[torch.Tensor, ...]) -> None:
        if not self.meta_sent:
            self.comm.send(encode_meta(tensors, self.device), self.next,
                           self.grid.pair_group(self.next))
            self.meta_sent = True

    def ensure_meta_received(self) -> list:
        if self.recv_meta is None:
            meta = torch.empty(META_LEN, dtype=torch.int64, device=self.device)
            self.comm.recv(meta, self.prev, self.grid.pair_group(self.prev))
            self.recv_meta = decode_meta(meta)
        return self.recv_meta

    def empty_activation(self) -> tuple[torch.Tensor, ...]:
        return tuple(torch.empty(s, dtype=d, device=self.device) for s, d, _ in self.recv_meta)

    def exchange(self, sends: list[tuple[torch.Tensor, int]],
                 recvs: list[tuple[torch.Tensor, int]]) -> None:
        """Post all sends and receives (one batch per neighbour, on that pair's group, in rank
        order) and wait for all of them."""
        peers = sorted({peer for _, peer in sends + recvs})
        if not peers:
            return
        try:
            works = []
            for peer in peers:
                works += self.comm.batch_isend_irecv([(t, p) for t, p in sends if p == peer],
                                                     [(t, p) for t, p in recvs if p == peer],
                                                     self.grid.pair_group(peer))
            for work in works:
                work.wait()
        except RuntimeError as e:
            names = ", ".join(f"rank {r} ({'previous' if r == self.prev else 'next'} stage)"
                              for r in peers)
            raise RuntimeError(f"point-to-point exchange with {names} failed: that rank died or "
                               f"timed out ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
                               ) from e
