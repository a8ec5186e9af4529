"""The distributed optimizer (`--use-distributed-optimizer`, Megatron's flag; ZeRO stage 1): each
of a stage's w data-parallel ranks keeps fp32 master weights and optimizer state for its shard
only, 1/w of the stage.

A sharding layer over the flat optimizers of optimizer.py: one inner optimizer per piece of this
rank's shard (`optim/shard_layout.py`: at most two contiguous ranges of the flat buffers), each
stepped through the same `step(src, grad, dst, lr)` on views of its piece, so the update
arithmetic is optimizer.py's alone (so is 2BW compensation's `predict`, per piece; so are the
lr classes of --decoupled-lr: each piece's optimizer gets the part of the decoupled ranges inside
it, and every lr argument passes through unchanged).
The engine (`pipeline/batch_step.py`) reduce-scatters the gradients so each rank holds its
shard's sum, calls `step`, and all-gathers the new weights (or their prediction) into the
version slot the schedule names.

    bf16/fp16: master piece <- update(master piece, grad piece); slot piece <- master piece
    fp32:      slot piece (dst) <- update(slot piece (src), grad piece)  (src may be dst)

Checkpoint state (`state_dict`, what `checkpoint/api.py` writes per data-parallel rank as
`distrib_optim_XXX.pt`; a new checkpoint format reads the same dict):

    {"sharded": {"count": w, "rank": r, "numel": n},   n: the stage's parameters (unpadded)
     "steps": k,
     "pieces": [{"range": (lo, hi),     global offsets in the unpadded parameter layout
                 "master": fp32 [hi - lo]           (bf16/fp16 only: the exact master weights)
                 "exp_avg", "exp_avg_sq": [hi - lo] (Adam) | "momentum": [hi - lo] (SGD),
                 "last_grad": [hi - lo]             (Adam with keep_grad: its latest gradient)}]}

Padding is never saved. `full_state([shard dicts of all ranks])` reassembles the unsharded form
({"exp_avg": [n], ..., "steps": k, "master": [n]}, the same keys as the flat optimizers'
state_dict plus "master"), and `load_state_dict` takes a shard dict of the same layout, every
rank's shard dicts (any w), or the unsharded form: a checkpoint moves between w and between
sharded and unsharded runs. A state without a key the optimizer may miss (`OPTIONAL_STATE`:
last_grad) loads as the flat optimizers load it.
"""
from __future__ import annotations

import torch

from megatron_2bw.config import OptimizerConfig
from megatron_2bw.optim.optimizer import OPTIONAL_STATE, make_optimizer
from megatron_2bw.optim.segments import within


class DistributedOptimizer:
    """Steps this rank's shard of a stage's flat weights (`weights`: a sharded VersionedWeights)."""

    def __init__(self, cfg: OptimizerConfig, weights, device, keep_grad: bool = False,
                 decoupled=()):
        """`decoupled`: the padded (lo, hi) ranges of the flat layout at lr class 1
        (optimizer.py), each piece's inner optimizer gets their part of it."""
        self.weights = weights
        self.pieces = weights.pieces
        self.count = weights.layout.count
        self.rank = weights.shard_rank
        self.numel = weights.layout.real_numel
        self.inner = [make_optimizer(cfg, p.size, min(max(weights.decay_end - p.lo, 0), p.size),
                                     device, keep_grad=keep_grad,
                                     decoupled=[(a - p.lo, b - p.lo)
                                                for a, b in within(decoupled, p.lo, p.hi)])
                      for p in self.pieces]

    @property
    def impl(self) -> str:
        """The kernel stepping the shard (optim/kernels.py), as the flat optimizers say."""
        return self.inner[0].impl if self.inner else "none (an empty shard)"

    def step(self, src: torch.Tensor, grad: torch.Tensor, dst: torch.Tensor, lr: float) -> None:
        """Update this rank's pieces of the padded flat `dst` from `src` (or the master) and
        `grad` (which must hold the reduced gradient on these pieces)."""
        masters = self.weights.master_pieces() if self.weights.master is not None else None
        for i, (p, opt) in enumerate(zip(self.pieces, self.inner)):
            g, d = grad[p.lo:p.hi], dst[p.lo:p.hi]
            if masters is not None:
                opt.step(masters[i], g, masters[i], lr)
                d.copy_(masters[i])
            else:
                opt.step(d if src is dst else src[p.lo:p.hi], g, d, lr)

    # -- 2BW compensation (pipeline/compensation.py): the flat optimizers' pure functions, per piece
    def predict(self, src: torch.Tensor, dst: torch.Tensor, lr: float, nesterov: bool = False,
                spike: tuple | None = None) -> None:
        """This rank's pieces of the padded flat `dst` <- the prediction from `src`'s pieces (the
        sharded master, or a padded flat buffer); `spike` = (padded flat grad, reduced on these
        pieces; lr of its step) first corrects src's pieces. The caller all-gathers `dst`."""
        for s, p, opt in zip(self._pieces(src), self.pieces, self.inner):
            opt.predict(s, dst[p.lo:p.hi], lr, nesterov=nesterov,
                        spike=None if spike is None else (spike[0][p.lo:p.hi], spike[1]))

    def _pieces(self, flat: torch.Tensor) -> list:
        if flat is self.weights.master:
            return self.weights.master_pieces()
        return [flat[p.lo:p.hi] for p in self.pieces]

    # -- checkpoint state -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        masters = self.weights.master_pieces() if self.weights.master is not None else None
        pieces = []
        for i, (p, opt) in enumerate(zip(self.pieces, self.inner)):
            state = {k: v[:p.real] for k, v in opt.state_dict().items() if torch.is_tensor(v)}
            if masters is not None:
                state["master"] = masters[i][:p.real]
            pieces.append({"range": p.global_range, **state})
        steps = self.inner[0].state_dict()["steps"] if self.inner else 0
        return {"sharded": {"count": self.count, "rank": self.rank, "numel": self.numel},
                "steps": steps, "pieces": pieces}

    def load_state_dict(self, state) -> bool:
        """Load any of the forms in the module docstring; True when it restored the master
        weights (bf16/fp16 shards or an unsharded state with "master")."""
        if isinstance(state, (list, tuple)) or "sharded" not in state or \
                state["sharded"]["count"] != self.count or state["sharded"]["rank"] != self.rank:
            state = _shard_view(full_state(state), self.pieces, self.numel)
        if state["sharded"]["numel"] != self.numel:
            raise ValueError(f"optimizer state holds {state['sharded']['numel']} parameters, this "
                             f"stage {self.numel} (different model shape or parallel layout)")
        restored = False
        masters = self.weights.master_pieces() if self.weights.master is not None else None
        for i, (p, opt, saved) in enumerate(zip(self.pieces, self.inner, state["pieces"])):
            own = opt.state_dict()
            padded = {k: _padded(saved[k], v) for k, v in own.items()
                      if torch.is_tensor(v) and (k in saved or k not in OPTIONAL_STATE)}
            opt.load_state_dict({**padded, "steps": state["steps"]})
            if masters is not None and "master" in saved:
                masters[i][:p.real].copy_(saved["master"])
                restored = True
        return restored


def _padded(saved: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(own)
    out[:saved.numel()].copy_(saved)
    return out


def full_state(state) -> dict:
    """The unsharded form of `state`: every rank's shard dicts (a list), one shard dict of an
    unsharded run's count 1, or already the unsharded form (returned as it is)."""
    shards = list(state) if isinstance(state, (list, tuple)) else [state]
    if "sharded" not in shards[0]:
        return shards[0]
    info = shards[0]["sharded"]
    counts = {s["sharded"]["count"] for s in shards}
    ranks = sorted(s["sharded"]["rank"] for s in shards)
    if counts != {info["count"]} or ranks != list(range(info["count"])):
        raise ValueError(f"optimizer shards of ranks {ranks} do not cover the {info['count']} "
                         "data-parallel ranks they were saved by: the checkpoint is incomplete")
    n, out = info["numel"], {"steps": shards[0]["steps"]}
    for shard in shards:
        for piece in shard["pieces"]:
            lo, hi = piece["range"]
            for key, value in piece.items():
                if key == "range":
                    continue
                if key not in out:
                    out[key] = torch.zeros(n, dtype=value.dtype, device=value.device)
                out[key][lo:hi].copy_(value)
    return out


def _shard_view(full: dict, pieces, numel: int) -> dict:
    """The shard dict of `pieces` cut out of an unsharded state of `numel` parameters."""
    out = []
    for p in pieces:
        lo, hi = p.global_range
        entry = {"range": (lo, hi)}
        for key, value in full.items():
            if torch.is_tensor(value) and value.dim() == 1:
                if value.numel() != numel:
                    raise ValueError(f"optimizer state {key!r} holds {value.numel()} values, this "
                                     f"stage has {numel} parameters (different model shape or "
                                     "parallel layout)")
                entry[key] = value[lo:hi]
        out.append(entry)
    return {"sharded": {"count": None, "rank": None, "numel": numel},
            "steps": int(full["steps"]), "pieces": out}


__all__ = ["DistributedOptimizer", "full_state"]
