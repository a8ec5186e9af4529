"""Start-up at 1024 ranks (issue 29, point 5): the grid of a t=8, d=16, w=8 layout set up in this
one process, as rank 517 of a world of 1024, on torch's fake process-group backend.

What is counted: the world-wide group creations the grid asks for (`Comm.split` calls: on NCCL
each is one `dist.split_group`, one ncclCommSplit over the world) and the torch `new_group`
calls of the fall-back the fake backend (like gloo) needs, which cannot split. The set-up time
is printed (README, "What a 1024-GPU start costs"), never asserted."""
import time
from collections import Counter

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from megatron_2bw.parallel.comm import Comm
from megatron_2bw.parallel.grid import ProcessGrid

T, D, W, RANK = 8, 16, 8, 517  # rank 517: a middle stage, in two stage pairs


@pytest.fixture
def fake_world():
    dist.init_process_group("fake", rank=RANK, world_size=T * D * W, store=FakeStore())
    yield
    dist.destroy_process_group()


def _count(monkeypatch):
    splits, created = [], []
    split, new_group = Comm.split, dist.new_group

    def counting_split(self, groups, desc, mine):
        splits.append((desc, [list(g) for g in groups]))
        return split(self, groups, desc, mine)

    def counting_new_group(*a, **kw):
        created.append(kw)
        return new_group(*a, **kw)

    monkeypatch.setattr(Comm, "split", counting_split)
    monkeypatch.setattr(dist, "new_group", counting_new_group)
    return splits, created


def test_a_1024_rank_grid_is_one_split_per_kind_of_group(fake_world, monkeypatch):
    splits, created = _count(monkeypatch)
    comm = Comm("cpu", "fake", timeout_minutes=0.1)
    start = time.perf_counter()
    grid = ProcessGrid(T, D, W, rank=RANK).init_groups(comm)
    seconds = time.perf_counter() - start
    per_kind = Counter(kind for kind, _ in splits)
    print(f"\n1024 ranks (t={T}, d={D}, w={W}) on the fake backend: {len(splits)} world-wide "
          f"splits {dict(per_kind)}; fall-back new_group calls: {len(created)}; set-up "
          f"{seconds * 1000:.0f} ms")
    assert per_kind == {"tp": 1, "dp": 1, "pp": 1, "mp": 1, "tied": 1, "pair": 2}
    assert max(per_kind.values()) <= 3
    everything = sorted(sorted(g) for groups in grid.all_group_ranks().values()
                        for g in groups if len(g) > 1)
    assert sorted(sorted(g) for _, groups in splits for g in groups) == everything, \
        "every group of more than one rank exactly once"
    for _, groups in splits:  # a split's groups are disjoint (split_group's contract)
        members = [r for g in groups for r in g]
        assert len(members) == len(set(members))
    # the fake backend cannot split: one new_group per group, each with the user's timeout
    assert not comm.can_split and len(created) == len(everything) == 1296
    assert {kw["timeout"].total_seconds() for kw in created} == {6.0}
    for kind in ("tp", "dp", "pp", "mp"):  # this rank's groups hold its neighbours
        assert dist.get_process_group_ranks(grid.group(kind)) == grid.group_ranks(kind)
    assert grid.group("tied") is None, "a middle stage holds no tied embedding"
    assert sorted(grid.pairs) == [grid.prev_rank, grid.next_rank]
    for peer, group in grid.pairs.items():
        assert sorted(dist.get_process_group_ranks(group)) == sorted([RANK, peer])


def test_under_nccl_the_gradient_pairs_add_two_splits_not_960_groups():
    """The plan NCCL runs (no process group needed): 9 ncclCommSplits for the whole grid where
    creating every group world-wide took 2256 (1296 groups and the 960 gradient pair groups)."""
    grid = ProcessGrid(T, D, W, rank=RANK, comm=Comm("cuda:0", "nccl"))
    splits = grid.group_splits()
    assert Counter(kind for kind, _ in splits) == {"tp": 1, "dp": 1, "pp": 1, "mp": 1,
                                                   "tied": 1, "pair": 2, "pair_grads": 2}
    assert sum(len(groups) for _, groups in splits) == 2256


def test_where_the_backend_splits_each_split_is_one_split_group_call(monkeypatch):
    """NCCL's path without GPUs: `can_split` as a GPU node has it, `dist.split_group` recorded
    (its signature checked); each call gets every group of the kind, the timeout and the kind."""
    import inspect
    assert {"split_ranks", "timeout", "group_desc"} <= set(
        inspect.signature(dist.split_group).parameters)
    calls = []

    def split_group(**kw):
        calls.append(kw)
        mine = [g for g in kw["split_ranks"] if RANK in g]
        return f"{kw['group_desc']}:{mine[0]}" if mine else None

    monkeypatch.setattr(Comm, "can_split", property(lambda self: True))
    monkeypatch.setattr(dist, "split_group", split_group)
    monkeypatch.setattr(dist, "new_group", lambda *a, **kw: pytest.fail("new_group on NCCL"))
    grid = ProcessGrid(T, D, W, rank=RANK).init_groups(Comm("cuda:0", "nccl", 0.1))
    assert len(calls) == 9 and {c["timeout"].total_seconds() for c in calls} == {6.0}
    assert [c["group_desc"] for c in calls] == ["tp", "dp", "pp", "mp", "tied", "pair", "pair",
                                                "pair_grads", "pair_grads"]
    assert grid.group("dp") == f"dp:{grid.group_ranks('dp')}"
    assert grid.pair_group(grid.next_rank) != grid.pair_group(grid.next_rank, gradients=True)
    assert sorted(grid.pair_grads) == [grid.prev_rank, grid.next_rank]
