"""The process grid: which rank holds which (tensor, pipeline, data) coordinate, and its groups.

No module-level state: one `ProcessGrid` object per process. Coordinates are pure arithmetic (unit
tested without processes); `init_groups(comm)` creates the torch.distributed groups through the
grid's `Comm` (comm.py), which every collective of the package then goes through: one
world-wide split per kind of group (`group_splits`; on NCCL one ncclCommSplit each, 9 for a
1024-rank grid instead of 2256 group creations), each group with the user's timeout.

Rank order names the axes from innermost (fastest varying) to outermost:
  "tp-dp-pp" (Megatron's default): rank = tp + t * (dp + w * pp)
  "tp-pp-dp":                      rank = tp + t * (pp + d * dp)
Tensor parallel is always innermost so a stage's tensor group stays inside a node.

Group kinds: tp, dp, pp, mp (one replica: every stage and tensor rank of a data-parallel index),
tied (first and last stage, every replica, per tensor rank) and pair: one group per neighbouring
pair of stages of each pipeline, [rank of stage s, rank of stage s+1], which the point-to-point
of that pair uses (`pair_group(peer)`), so a batched send never involves another rank. Under
NCCL a pair has a second group, right after the first, for the gradients (s+1 -> s; the first
carries the activations s -> s+1): one NCCL communicator runs its operations in posting order,
so a receive posted early on a shared one could hold back a send the peer is waiting for
(parallel/p2p.py). gloo matches each direction separately and shares one group.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_2bw.config import RANK_ORDERS
from megatron_2bw.parallel.comm import Comm, PeerError, describe_ranks, peer_error


@dataclass
class ProcessGrid:
    tensor: int
    pipeline: int
    data: int
    rank: int = 0
    rank_order: str = "tp-dp-pp"
    groups: dict = field(default_factory=dict, repr=False)
    pairs: dict = field(default_factory=dict, repr=False)   # neighbour's global rank -> group
    pair_grads: dict = field(default_factory=dict, repr=False)  # NCCL: the gradients' groups
    comm: Comm = field(default_factory=Comm, repr=False, compare=False)

    def __post_init__(self):
        if self.rank_order not in RANK_ORDERS:
            raise ValueError(f"unknown rank order {self.rank_order!r}: use one of {RANK_ORDERS}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world of {self.world_size}")

    @classmethod
    def from_config(cls, cfg, rank: int, world_size: int) -> "ProcessGrid":
        """The layout of `cfg` (a config.Config) on `world_size` ranks, seen from `rank`: the
        training loop's, the DeepSpeed adapter's and the data roles'. No process group yet:
        `init_groups(comm)` creates them."""
        return cls(cfg.parallel.tensor, cfg.parallel.pipeline,
                   cfg.resolved(world_size).data_parallel_size, rank=rank,
                   rank_order=cfg.parallel.rank_order)

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

    def describe(self, rank: int | None = None) -> str:
        """"rank R (stage S/D, data-parallel replica W, tensor rank T)" of this rank or `rank`."""
        r = self.rank if rank is None else rank
        tp, stage, dp = self.coords(r)
        return (f"rank {r} (stage {stage}/{self.pipeline}, data-parallel replica {dp}, tensor "
                f"rank {tp})")

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
            kinds["pair"] = [[r(i, p, q), r(i, p + 1, q)]
                             for i in range(t) for q in range(w) for p in range(d - 1)]
        return kinds

    def group_ranks(self, kind: str) -> list[int]:
        """Members of this rank's group of `kind` (not "pair": a rank has two, see pairs)."""
        for ranks in self.all_group_ranks().get(kind, []):
            if self.rank in ranks:
                return ranks
        return []

    def group_splits(self) -> list[tuple[str, list[list[int]]]]:
        """The groups to create, as (kind, disjoint groups) splits in a fixed order all ranks
        agree on: one split per kind; the stage pairs in two (pairs starting at an even stage,
        then at an odd one: a rank is in the pair before and the pair after its stage), and
        under NCCL the gradients' pair groups in two more. Groups of one are left out (they
        need no communication) and so is a kind with no group left."""
        splits = []
        for kind, all_ranks in self.all_group_ranks().items():
            groups = [ranks for ranks in all_ranks if len(ranks) > 1]
            if kind != "pair":
                splits += [(kind, groups)] if groups else []
                continue
            by_parity = [[g for g in groups if self.coords(g[0])[1] % 2 == parity]
                         for parity in (0, 1)]
            splits += [("pair", g) for g in by_parity if g]
            if self.split_pairs:
                splits += [("pair_grads", g) for g in by_parity if g]
        return splits

    def init_groups(self, comm: Comm | None = None) -> "ProcessGrid":
        """Create the torch.distributed groups through `comm` (default: the grid's, which takes
        its device from the process group): one `Comm.split` per entry of `group_splits`, each
        group with the Comm's timeout. Collective: every rank must call it, after the process
        group started on the rank's device (distributed.start_process_group)."""
        if comm is not None:
            self.comm = comm
        self.comm.name_ranks = self.name_ranks  # its error lines name stages and replicas too
        for kind, groups in self.group_splits():
            mine = next((i for i, g in enumerate(groups) if self.rank in g), None)
            group = self.comm.split(groups, kind, mine)
            if mine is None:
                continue
            ranks = groups[mine]
            if kind in ("pair", "pair_grads"):
                peer = ranks[1] if ranks[0] == self.rank else ranks[0]
                (self.pairs if kind == "pair" else self.pair_grads)[peer] = group
            else:
                self.groups[kind] = group
        return self

    def name_ranks(self, ranks: list[int]) -> str:
        """"rank 1 (stage 1/2, data-parallel replica 0, tensor rank 0)" for one rank, "one of
        ranks 1 (stage 1/2, ...), 3 (...)" for a few, a count for many: the ranks an error line
        says this rank waited for."""
        def one(r: int) -> str:
            tp, stage, dp = self.coords(r)
            return (f"{r} (stage {stage}/{self.pipeline}, data-parallel replica {dp}, tensor rank "
                    f"{tp})")
        return describe_ranks([r for r in ranks if r != self.rank], one)

    def peer_error(self, e: BaseException, what: str, kind: str | None = None,
                   ranks: list[int] | None = None) -> PeerError:
        """The one-line PeerError of a wait on `what` that failed with `e`, naming the peer(s):
        `ranks`, else this rank's group of `kind` (None: the world)."""
        if ranks is None:
            ranks = self.group_ranks(kind) if kind else list(range(self.world_size))
        return peer_error(e, self.name_ranks(ranks), what, self.comm.timeout_s)

    @property
    def split_pairs(self) -> bool:
        """Whether each stage pair has a group per direction (NCCL; see the module docstring)."""
        return self.comm.backend == "nccl"

    def pair_group(self, peer: int, gradients: bool = False):
        """The two-rank group of this rank and its neighbouring stage `peer` (a global rank);
        with `gradients`, the one gradients flow in (the same group unless split_pairs)."""
        try:
            return self.pair_grads[peer] if gradients and peer in self.pair_grads \
                else self.pairs[peer]
        except KeyError:
            raise ValueError(f"rank {peer} is not a neighbouring stage of rank {self.rank}, or "
                             "init_groups() has not run") from None

    def group(self, kind: str):
        """The torch group of `kind` containing this rank, or None if it is a group of one."""
        return self.groups.get(kind)
