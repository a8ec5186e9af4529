"""The process grid: which rank holds which (tensor, pipeline, data) coordinate, and its groups.

No module-level state: one `ProcessGrid` object per process. Coordinates are pure arithmetic (unit
tested without processes); `init_groups()` creates the torch.distributed groups.

Rank order names the axes from innermost (fastest varying) to outermost:
  "tp-dp-pp" (Megatron's default): rank = tp + t * (dp + w * pp)
  "tp-pp-dp":                      rank = tp + t * (pp + d * dp)
Tensor parallel is always innermost so a stage's tensor group stays inside a node.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from ..config import RANK_ORDERS


@dataclass
class ProcessGrid:
    tensor: int
    pipeline: int
    data: int
    rank: int = 0
    rank_order: str = "tp-dp-pp"
    groups: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.rank_order not in RANK_ORDERS:
            raise ValueError(f"unknown rank order {self.rank_order!r}: use one of {RANK_ORDERS}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world of {self.world_size}")

    # -- arithmetic -----------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.tensor * self.pipeline * self.data

    def rank_of(self, tp: int, pp: int, dp: int) -> int:
        t, d, w = self.tensor, self.pipeline, self.data
        if self.rank_order == "tp-dp-pp":
            return tp + t * (dp + w * pp)
        return tp + t * (pp + d * dp)

    def coords(self, rank: int | None = None) -> tuple[int, int, int]:
        """(tp, pp, dp) of a rank (default: this one)."""
        r = self.rank if rank is None else rank
        t, d, w = self.tensor, self.pipeline, self.data
        tp, rest = r % t, r // t
        if self.rank_order == "tp-dp-pp":
            return tp, rest // w, rest % w
        return tp, rest % d, rest // d

    @property
    def tp_rank(self) -> int:
        return self.coords()[0]

    @property
    def stage(self) -> int:
        return self.coords()[1]

    @property
    def dp_rank(self) -> int:
        return self.coords()[2]

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.pipeline - 1

    def stage_rank(self, stage: int) -> int:
        """Global rank of `stage` in this rank's pipeline (same tp and dp coordinates)."""
        tp, _, dp = self.coords()
        return self.rank_of(tp, stage, dp)

    @property
    def prev_rank(self) -> int | None:
        return None if self.is_first_stage else self.stage_rank(self.stage - 1)

    @property
    def next_rank(self) -> int | None:
        return None if self.is_last_stage else self.stage_rank(self.stage + 1)

    # -- group membership (lists of global ranks) -------------------------------------------------
    def all_group_ranks(self) -> dict[str, list[list[int]]]:
        """Every group of every kind, in a fixed order all ranks agree on."""
        t, d, w = self.tensor, self.pipeline, self.data
        r = self.rank_of
        kinds = {
            "tp": [[r(i, p, q) for i in range(t)] for p in range(d) for q in range(w)],
            "dp": [[r(i, p, q) for q in range(w)] for i in range(t) for p in range(d)],
            "pp": [[r(i, p, q) for p in range(d)] for i in range(t) for q in range(w)],
            # model parallel = one whole replica: global grad norm, loss broadcast
            "mp": [[r(i, p, q) for p in range(d) for i in range(t)] for q in range(w)],
        }
        if d > 1:  # tied embedding: first and last stage of every replica, per tensor rank
            kinds["tied"] = [sorted({r(i, p, q) for q in range(w) for p in (0, d - 1)})
                             for i in range(t)]
        return kinds

    def group_ranks(self, kind: str) -> list[int]:
        for ranks in self.all_group_ranks().get(kind, []):
            if self.rank in ranks:
                return ranks
        return []

    def init_groups(self) -> "ProcessGrid":
        """Create the torch.distributed groups (collective: every rank must call it)."""
        for kind, all_ranks in self.all_group_ranks().items():
            for ranks in all_ranks:
                if len(ranks) == 1:
                    continue  # a group of one needs no communication
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    self.groups[kind] = group
        return self

    def group(self, kind: str):
        """The torch group of `kind` containing this rank, or None if it is a group of one."""
        return self.groups.get(kind)
