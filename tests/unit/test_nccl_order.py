"""The NCCL-order validator (schedule/nccl_posts.py, schedule/nccl_order.py; issue 29 point 6):
every schedule kind of the registry on every layout with d <= 8, w <= 2, t <= 2 (tied
embeddings, the distributed optimizer, compensation) replays without a wait cycle; broken orders
are rejected with the cycle printed; the interpreter posts receives early only where the
validator proved it safe (that its program is what the real interpreter posts:
test_nccl_order_interpreter.py)."""
import itertools

import pytest

from megatron_2bw.parallel.grid import ProcessGrid
from megatron_2bw.schedule import (CommLayout, NcclOrderError, check_nccl_order,
                                   early_receives_safe)
from megatron_2bw.schedule.kinds import FORWARD_ONLY, schedule_kind, schedule_names
from megatron_2bw.schedule.nccl_posts import POST, WAIT, rank_of, stage_program
from megatron_2bw.schedule.tables import forward_only, make_schedule

KINDS = [schedule_kind(n) for n in schedule_names()] + [schedule_kind(FORWARD_ONLY)]


def _schedule(kind, d, m, t0=0):
    if not kind.is_training:
        return forward_only(d, m)
    return make_schedule(kind, d, m, num_batches=10 ** 9, first_batch=t0)


def _cases(stages):
    """(kind, d, m, first batch, layout) for every kind, d in `stages`, t, w <= 2, the options."""
    for kind, d, t, w in itertools.product(KINDS, stages, (1, 2), (1, 2)):
        low = kind.min_microbatches(d)
        for m in sorted({low, d, d + 1}):
            if not kind.accepts(d, m):
                continue
            for t0 in (range(2 * kind.num_slots) if kind.is_training else (0,)):
                for sharded, comp, views, early in itertools.product(
                        (False, True) if w > 1 else (False,),
                        (False, True) if kind.delay == 1 else (False,), (False, True),
                        (False, True) if w > 1 else (False,)):
                    if views and not (sharded or comp):
                        continue  # (a view posts nothing then)
                    yield kind, d, m, t0, CommLayout(
                        tensor=t, data=w, distributed_optimizer=sharded, compensation=comp,
                        views=views, sequence_parallel=t > 1, tied=True, early_reduce=early)


def _ids(case):
    kind, d, m, t0, L = case
    return (f"{kind.name}-d{d}-m{m}-t0{t0}-t{L.tensor}w{L.data}"
            f"{'-distopt' if L.distributed_optimizer else ''}{'-comp' if L.compensation else ''}"
            f"{'-views' if L.views else ''}{'-early' if L.early_reduce else ''}")


ALL = list(_cases(range(1, 9)))
# the default run: d <= 4 from batch 0 and resumed after the warm-up (t0 = slots), every m and
# option; d = 8 at t = w = 2, m = 8 past the warm-up (2bw: every option; the others: all on).
# The rest (other phases, d = 5..8) is marked slow.
FAST = [c for c in ALL if (c[1] <= 4 and c[3] in (0, c[0].num_slots)) or
        (c[1] == 8 and c[2] == 8 and c[3] == min(2, c[0].num_slots) * c[0].is_training and
         c[4].tensor == c[4].data == 2 and (c[0].delay == 1 or c[4].views))]
SLOW = [c for c in ALL if c not in FAST]


def _check_all(cases):
    for case in cases:
        kind, d, m, t0, layout = case
        try:  # the full replay with receives posted early, as the engine does
            assert early_receives_safe(_schedule(kind, d, m, t0), layout), _ids(case)
        except NcclOrderError as e:
            raise AssertionError(f"{_ids(case)}: {e}") from None


def test_every_registry_schedule_and_layout_is_nccl_safe():
    """All kinds, d <= 4 (every m and option, two phases) and d = 8 at t = w = 2: ~5 s."""
    assert {c[0].name for c in FAST} == {k.name for k in KINDS}
    _check_all(FAST)


@pytest.mark.slow
def test_every_registry_schedule_and_layout_is_nccl_safe_up_to_8_stages():
    _check_all(SLOW)


# ---- broken orders are rejected, with the cycle printed -------------------------------------


def test_an_early_receive_on_a_shared_pair_communicator_is_a_printed_cycle():
    """One NCCL group per stage pair (gloo's layout) with 1F1B's early receives: stage 3 posts
    ra1 early before its sg0, stage 2 posts rg0 before its sa1: each heads its queue on the one
    communicator, waiting for what queues behind the other's."""
    flush = make_schedule("flush", 4, 4)
    with pytest.raises(NcclOrderError) as e:
        check_nccl_order(flush, CommLayout(split_pairs=False))
    text = str(e.value)
    assert text.startswith("NCCL wait cycle over ranks [2, 3] on pair[2,3]:"), text
    assert "rank 2 (stage 2, tp 0, dp 0)'s rg0 (posted early) [2sa0 2ra1] on pair[2,3] needs " \
           "rank 3 (stage 3, tp 0, dp 0)'s sg0, queued behind ra1 (posted early)" in text
    assert {c[0] for c in e.value.cycle} == {2, 3} and {c[1] for c in e.value.cycle} == \
        {"pair[2,3]"}
    # there even receives at their own groups deadlock: a send heads each queue (sa1 | sg0)
    with pytest.raises(NcclOrderError, match=r"can deadlock under NCCL: NCCL wait cycle over "
                                             r"ranks \[2, 3\] on pair\[2,3\]"):
        early_receives_safe(flush, CommLayout(split_pairs=False))
    assert early_receives_safe(flush, CommLayout()) is True  # NCCL's layout: a group each way


def _move_tied_after_norm(ranks):
    """The last stage starts batch 0's tied all-reduce only after it waited for the norm: the
    two collectives in different orders on stage 0 (tied, then norm) and stage 1."""
    prog = ranks[1].prog
    tied = [x for x in prog if x[1].what == "tied-embedding all-reduce R0"]
    for x in tied:
        prog.remove(x)
    j = next(j for j, (k, op, _) in enumerate(prog)
             if k == WAIT and op.what == "grad-norm all-reduce N0")
    prog[j + 1:j + 1] = tied


def test_two_collectives_in_different_orders_on_two_ranks_are_a_printed_cycle():
    sched = make_schedule("2bw", 2, 2)
    check_nccl_order(sched, CommLayout())
    with pytest.raises(NcclOrderError) as e:
        check_nccl_order(sched, CommLayout(), edit=_move_tied_after_norm)
    text = str(e.value)
    assert text.startswith("NCCL wait cycle over ranks [0, 1] on mp[0,1], tied[0,1]:"), text
    assert "rank 0 (stage 0, tp 0, dp 0) blocks in 0N0 waiting for tied-embedding all-reduce " \
           "R0 on tied[0,1]" in text
    assert "rank 1 (stage 1, tp 0, dp 0) blocks in 1S0 waiting for grad-norm all-reduce N0 " \
           "on mp[0,1]" in text
    assert {c[1] for c in e.value.cycle} == {"tied[0,1]", "mp[0,1]"}


def test_collectives_of_one_communicator_in_different_orders_are_a_mismatch():
    def swap_first_two_dp_posts(ranks):
        """Replica 0 of stage 0 posts batch 0's gather where the others post its reduce-scatter
        and the other way round: the first collective on the dp group differs."""
        first, second = [x[1] for x in ranks[0].prog
                         if x[0] == POST and x[1].comm.startswith("dp")][:2]
        first._what, second._what = second._what, first._what
    with pytest.raises(NcclOrderError, match=r"collective order differs on dp\[0,1\]: its "
                                             r"collective #0 is (all-gather|reduce-scatter)"):
        check_nccl_order(make_schedule("2bw", 2, 2), CommLayout(data=2, distributed_optimizer=True),
                         edit=swap_first_two_dp_posts)


def test_a_receive_nobody_sends_is_reported():
    def drop_sends(ranks):
        ranks[0].prog[:] = [x for x in ranks[0].prog if not (x[1].parts and
                                                             x[1].parts[0][0] == "send")]
    with pytest.raises(NcclOrderError, match=r"rank 1 \(stage 1, tp 0, dp 0\)'s shape handshake"
                                             r" \(recv\) \[1ra0\] on pair-act\[0,1\] needs rank 0"):
        check_nccl_order(forward_only(2, 2), CommLayout(), edit=drop_sends)


def test_bad_layouts_are_one_line_errors():
    with pytest.raises(ValueError, match=r"CommLayout.tensor must be an integer >= 1, got 0"):
        CommLayout(tensor=0)
    with pytest.raises(ValueError, match=r"CommLayout.rank_order 'pp-dp'"):
        CommLayout(rank_order="pp-dp")


# ---- the replayed groups and posting order are the engine's ----------------------------------


@pytest.mark.parametrize("t,d,w,order", [(2, 4, 2, "tp-dp-pp"), (2, 3, 2, "tp-pp-dp"),
                                         (1, 2, 2, "tp-dp-pp")])
def test_the_communicators_are_the_grids_groups(t, d, w, order):
    grid = ProcessGrid(t, d, w, rank_order=order)
    layout = CommLayout(tensor=t, data=w, rank_order=order)
    groups = grid.all_group_ranks()
    mine = {kind: set() for kind in groups}
    for tp, s, dp in itertools.product(range(t), range(d), range(w)):
        assert rank_of(tp, s, dp, layout.tensor, d, layout.data, layout.rank_order) == \
            grid.rank_of(tp, s, dp)
        rank = stage_program(make_schedule("flush", d, d), layout, tp, s, dp)
        for name, members in rank.members.items():
            kind = name.split("[")[0]
            if kind in mine:
                mine[kind].add(tuple(members))
        if rank.next is not None:
            assert rank.comms["act-out"] == f"pair-act[{rank.rank},{rank.next}]"
            assert rank.comms["grad-in"] == f"pair-grad[{rank.rank},{rank.next}]"
            mine["pair"].add((rank.rank, rank.next))
    for kind in ("tp", "dp", "mp", "tied", "pair"):
        want = {tuple(sorted(g)) for g in groups.get(kind, []) if len(g) > 1}
        assert {tuple(sorted(g)) for g in mine[kind]} == want, kind


def test_sends_in_another_order_than_their_receives_are_a_mismatch():
    def swap_first_two_sends(ranks):
        prog = ranks[0].prog
        i, j = [k for k, x in enumerate(prog) if x[0] == POST and x[1].parts
                and x[1].parts[0][0] == "send" and x[1].parts[0][2][0] == "sa"][:2]
        prog[i], prog[j] = prog[j], prog[i]
    with pytest.raises(NcclOrderError, match=r"point-to-point order differs on pair-act\[0,1\]: "
                                             r"rank 0 \(stage 0, tp 0, dp 0\) \[0sa1\] posts sa1 "
                                             r"as message #1 from rank 0 to rank 1, which rank 1 "
                                             r"\(stage 1, tp 0, dp 0\) posted as ra0 \[1ra0\]"):
        check_nccl_order(forward_only(2, 3), CommLayout(), edit=swap_first_two_sends)


def test_each_pair_communicator_starts_with_a_rendezvous_of_its_two_ranks():
    """lazy_p2p_init: NCCL may create a pair's communicator at its first operation, which then
    blocks both ranks until both reach it; the replay puts that first on each one it uses."""
    from megatron_2bw.schedule.nccl_posts import INIT
    sched = make_schedule("2bw", 3, 3)
    for lazy in (True, False):
        rank = stage_program(sched, CommLayout(lazy_p2p_init=lazy), 0, 1, 0)
        inits = [op.comm for kind, op, _ in rank.prog if op.what == INIT and kind == POST]
        assert inits == (["pair-act[0,1]", "pair-act[1,2]", "pair-grad[1,2]", "pair-grad[0,1]"]
                         if lazy else [])
        check_nccl_order(sched, CommLayout(lazy_p2p_init=lazy))

