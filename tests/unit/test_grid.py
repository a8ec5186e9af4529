"""ProcessGrid rank arithmetic and group membership, without any process group."""
import itertools

import pytest

from megatron_2bw.parallel.grid import ProcessGrid

ORDERS = ("tp-dp-pp", "tp-pp-dp")
SHAPES = [(1, 1, 1), (1, 2, 1), (1, 1, 3), (2, 1, 1), (1, 2, 2), (2, 2, 1), (2, 2, 2),
          (1, 4, 2), (2, 3, 2), (3, 2, 4), (2, 4, 3)]
CASES = [pytest.param(t, d, w, order, id=f"t{t}-d{d}-w{w}-{order}")
         for (t, d, w) in SHAPES for order in ORDERS]


def grids(t, d, w, order):
    return [ProcessGrid(t, d, w, rank=r, rank_order=order) for r in range(t * d * w)]


@pytest.mark.parametrize("t,d,w,order", CASES)
def test_coords_and_rank_of_are_inverse_bijections(t, d, w, order):
    g = ProcessGrid(t, d, w, rank_order=order)
    assert g.world_size == t * d * w
    all_coords = list(itertools.product(range(t), range(d), range(w)))
    ranks = [g.rank_of(*c) for c in all_coords]
    assert sorted(ranks) == list(range(g.world_size))            # rank_of: onto the world
    for c, r in zip(all_coords, ranks):
        assert g.coords(r) == c                                 # coords o rank_of = id
    for r in range(g.world_size):
        assert g.rank_of(*g.coords(r)) == r                     # rank_of o coords = id
        tp, pp, dp = g.coords(r)
        assert 0 <= tp < t and 0 <= pp < d and 0 <= dp < w
    for gr in grids(t, d, w, order):                            # per-rank properties agree
        assert (gr.tp_rank, gr.stage, gr.dp_rank) == gr.coords() == g.coords(gr.rank)
        assert gr.is_first_stage == (gr.stage == 0)
        assert gr.is_last_stage == (gr.stage == d - 1)


@pytest.mark.parametrize("t,d,w,order", CASES)
def test_tensor_parallel_is_innermost(t, d, w, order):
    g = ProcessGrid(t, d, w, rank_order=order)
    for group in g.all_group_ranks()["tp"]:
        assert group == list(range(group[0], group[0] + t))     # consecutive ranks
        assert group[0] % t == 0
    for r in range(g.world_size):
        assert g.coords(r)[0] == r % t


@pytest.mark.parametrize("t,d,w", SHAPES)
def test_tp_dp_pp_order(t, d, w):
    """Megatron's default: consecutive tp-groups are data-parallel replicas of one stage."""
    g = ProcessGrid(t, d, w, rank_order="tp-dp-pp")
    for r in range(g.world_size):
        tp, pp, dp = g.coords(r)
        assert r == tp + t * (dp + w * pp)
        assert pp == r // (t * w)                               # a stage is one block of t*w ranks
    for pp in range(d):
        block = sorted(g.rank_of(i, pp, q) for i in range(t) for q in range(w))
        assert block == list(range(pp * t * w, (pp + 1) * t * w))
    if w > 1:   # the next tp-group is the same stage, next dp replica
        assert g.coords(t) == (0, 0, 1)
    elif d > 1:
        assert g.coords(t) == (0, 1, 0)


@pytest.mark.parametrize("t,d,w", SHAPES)
def test_tp_pp_dp_order(t, d, w):
    """Pipeline neighbours are adjacent tp-groups; a whole replica is one block of t*d ranks."""
    g = ProcessGrid(t, d, w, rank_order="tp-pp-dp")
    for r in range(g.world_size):
        tp, pp, dp = g.coords(r)
        assert r == tp + t * (pp + d * dp)
        assert dp == r // (t * d)
    for gr in grids(t, d, w, "tp-pp-dp"):
        if gr.next_rank is not None:
            assert gr.next_rank == gr.rank + t
        if gr.prev_rank is not None:
            assert gr.prev_rank == gr.rank - t
    for q in range(w):
        replica = sorted(g.rank_of(i, p, q) for i in range(t) for p in range(d))
        assert replica == list(range(q * t * d, (q + 1) * t * d))
    if d > 1:
        assert g.coords(t) == (0, 1, 0)
    elif w > 1:
        assert g.coords(t) == (0, 0, 1)


@pytest.mark.parametrize("t,d,w,order", CASES)
def test_groups_partition_the_world(t, d, w, order):
    g = ProcessGrid(t, d, w, rank_order=order)
    kinds = g.all_group_ranks()
    expected = {"tp", "dp", "pp", "mp"} | ({"tied", "pair"} if d > 1 else set())
    assert set(kinds) == expected
    sizes = {"tp": t, "dp": w, "pp": d, "mp": t * d}
    world = set(range(g.world_size))
    for kind in ("tp", "dp", "pp", "mp"):
        groups = kinds[kind]
        flat = [r for grp in groups for r in grp]
        assert sorted(flat) == sorted(world), kind              # each rank exactly once
        assert all(len(grp) == sizes[kind] for grp in groups), kind
        assert len(groups) == g.world_size // sizes[kind], kind
        for grp in groups:                                      # what the members share
            cs = [g.coords(r) for r in grp]
            if kind == "tp":
                assert len({(pp, dp) for _, pp, dp in cs}) == 1
            elif kind == "dp":
                assert len({(tp, pp) for tp, pp, _ in cs}) == 1
            elif kind == "pp":
                assert len({(tp, dp) for tp, _, dp in cs}) == 1
                assert [pp for _, pp, _ in cs] == list(range(d))  # in stage order
            else:
                assert len({dp for _, _, dp in cs}) == 1
    # group_ranks: the one group of each kind holding the rank
    for gr in grids(t, d, w, order):
        for kind in ("tp", "dp", "pp", "mp"):
            mine = gr.group_ranks(kind)
            assert gr.rank in mine
            assert sum(gr.rank in grp for grp in kinds[kind]) == 1


@pytest.mark.parametrize("t,d,w,order", CASES)
def test_pair_groups_are_the_neighbouring_stages_of_each_pipeline(t, d, w, order):
    g = ProcessGrid(t, d, w, rank_order=order)
    pairs = g.all_group_ranks().get("pair", [])
    assert len(pairs) == t * w * (d - 1)
    for a, b in pairs:
        (ta, pa, da), (tb, pb, db) = g.coords(a), g.coords(b)
        assert (ta, da) == (tb, db) and pb == pa + 1
    for gr in grids(t, d, w, order):   # each rank: one pair per neighbour, none else
        mine = sorted(tuple(p) for p in pairs if gr.rank in p)
        expected = sorted([(gr.prev_rank, gr.rank)] * (gr.prev_rank is not None) +
                          [(gr.rank, gr.next_rank)] * (gr.next_rank is not None))
        assert mine == expected


@pytest.mark.parametrize("t,d,w,order", CASES)
def test_tied_group(t, d, w, order):
    g = ProcessGrid(t, d, w, rank_order=order)
    kinds = g.all_group_ranks()
    if d == 1:
        assert "tied" not in kinds
        assert all(gr.group_ranks("tied") == [] for gr in grids(t, d, w, order))
        return
    tied = kinds["tied"]
    assert len(tied) == t
    for i, grp in enumerate(tied):
        expected = sorted({g.rank_of(i, p, q) for q in range(w) for p in (0, d - 1)})
        assert grp == expected
        assert len(grp) == 2 * w
        assert all(g.coords(r)[0] == i and g.coords(r)[1] in (0, d - 1) for r in grp)
    members = [r for grp in tied for r in grp]
    assert len(members) == len(set(members))                   # disjoint across tp coordinates
    for gr in grids(t, d, w, order):
        if gr.is_first_stage or gr.is_last_stage:
            assert gr.rank in gr.group_ranks("tied")
        else:
            assert gr.group_ranks("tied") == []


@pytest.mark.parametrize("t,d,w,order", CASES)
def test_prev_next_rank_consistent(t, d, w, order):
    gs = grids(t, d, w, order)
    for gr in gs:
        tp, pp, dp = gr.coords()
        if pp == 0:
            assert gr.prev_rank is None
        else:
            prev = gs[gr.prev_rank]
            assert prev.coords() == (tp, pp - 1, dp)
            assert prev.next_rank == gr.rank
        if pp == d - 1:
            assert gr.next_rank is None
        else:
            nxt = gs[gr.next_rank]
            assert nxt.coords() == (tp, pp + 1, dp)
            assert nxt.prev_rank == gr.rank
        assert [gr.stage_rank(s) for s in range(d)] == gr.group_ranks("pp")


def test_known_layout_t2_d2_w2():
    a = ProcessGrid(2, 2, 2, rank_order="tp-dp-pp").all_group_ranks()
    assert a["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert a["dp"] == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert a["pp"] == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert a["tied"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    b = ProcessGrid(2, 2, 2, rank_order="tp-pp-dp").all_group_ranks()
    assert b["pp"] == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert b["dp"] == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert b["mp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_invalid_rank_order_raises():
    with pytest.raises(ValueError, match="rank order"):
        ProcessGrid(1, 2, 1, rank_order="pp-dp-tp")


@pytest.mark.parametrize("rank", [-1, 8, 9])
def test_out_of_range_rank_raises(rank):
    with pytest.raises(ValueError, match="outside world"):
        ProcessGrid(2, 2, 2, rank=rank)
