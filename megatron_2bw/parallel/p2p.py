"""Point-to-point between neighbouring stages: one batched isend/irecv per communication group,
and a one-time shape/dtype handshake per run so receivers can allocate buffers."""
from __future__ import annotations

import torch
import torch.distributed as dist

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
    meta = torch.zeros(META_LEN, dtype=torch.int64)
    meta[:len(values)] = torch.tensor(values, dtype=torch.int64)
    return meta.to(device)


def decode_meta(meta: torch.Tensor) -> list[tuple[torch.Size, torch.dtype, bool]]:
    v = meta.tolist()
    out, i = [], 1
    for _ in range(v[0]):
        dtype, req, ndim = _DTYPES[v[i]], bool(v[i + 1]), v[i + 2]
        out.append((torch.Size(v[i + 3:i + 3 + ndim]), dtype, req))
        i += 3 + ndim
    return out


class P2P:
    def __init__(self, prev_rank: int | None, next_rank: int | None, device):
        self.prev, self.next, self.device = prev_rank, next_rank, torch.device(device)
        self.reset()

    def reset(self) -> None:
        """Start of a run (training segment or evaluation): the handshake happens again."""
        self.meta_sent = False
        self.recv_meta: list | None = None

    def ensure_meta_sent(self, tensors: tuple[torch.Tensor, ...]) -> None:
        if not self.meta_sent:
            dist.send(encode_meta(tensors, self.device), self.next)
            self.meta_sent = True

    def ensure_meta_received(self) -> list:
        if self.recv_meta is None:
            meta = torch.empty(META_LEN, dtype=torch.int64, device=self.device)
            dist.recv(meta, self.prev)
            self.recv_meta = decode_meta(meta)
        return self.recv_meta

    def empty_activation(self) -> tuple[torch.Tensor, ...]:
        return tuple(torch.empty(s, dtype=d, device=self.device) for s, d, _ in self.recv_meta)

    def exchange(self, sends: list[tuple[torch.Tensor, int]],
                 recvs: list[tuple[torch.Tensor, int]]) -> None:
        """Post all sends and receives as one batch and wait for all of them."""
        ops = [dist.P2POp(dist.isend, t, peer) for t, peer in sends]
        ops += [dist.P2POp(dist.irecv, t, peer) for t, peer in recvs]
        if not ops:
            return
        try:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        except RuntimeError as e:
            peers = sorted({peer for _, peer in sends + recvs})
            names = ", ".join(f"rank {r} ({'previous' if r == self.prev else 'next'} stage)"
                              for r in peers)
            raise RuntimeError(f"point-to-point exchange with {names} failed: that rank died or "
                               f"timed out ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
                               ) from e
