"""Schedules (gpipe, flush, 2bw, forward-only), the simulator/validator and the grid printer.

Golden grids live in tests/golden/; regenerate with
`UPDATE_GOLDEN=1 python -m pytest tests/unit/test_schedules.py`.
"""
import os
import re
from pathlib import Path

import pytest

from megatron_2bw.schedule import actions as A
from megatron_2bw.schedule.simulate import ScheduleError, format_grid, simulate, validate
from megatron_2bw.schedule.tables import (Schedule, forward_only, generate_table, make_schedule,
                                          split_windows)

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
KINDS = ("gpipe", "flush", "2bw")


def _ms(kind, d):
    """A few valid microbatch counts per kind (2bw needs m >= d)."""
    return sorted({m for m in (1, max(d - 1, 1), d, d + 1, 2 * d, 2 * d + 1)
                   if m >= {"2bw": d}.get(kind, 1)})


# ---- golden grids ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("d", [2, 4])
@pytest.mark.parametrize("m", [4, 8])
def test_golden_grid(kind, d, m):
    grid = format_grid(make_schedule(kind, d, m, num_batches=3)) + "\n"
    path = GOLDEN / f"{kind}_d{d}_m{m}.txt"
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.mkdir(exist_ok=True)
        path.write_text(grid)
    assert path.exists(), f"missing {path}; run with UPDATE_GOLDEN=1"
    assert grid == path.read_text()


def test_grid_shapes():
    rows = format_grid(make_schedule("gpipe", 2, 3)).splitlines()
    assert rows[0].split("|")[1].split() == ["F0v0", "F1v0", "F2v0", ".", ".", "B2v0", "B1v0",
                                             "B0v0", "S0"]
    rows = format_grid(make_schedule("flush", 2, 3)).splitlines()
    assert rows[1].split("|")[1].split() == [".", "F0v0", "B0v0", "F1v0", "B1v0", "F2v0", "B2v0",
                                             ".", "S0"]
    # 2bw: no flush between batches, versions alternate batch by batch
    cells = format_grid(make_schedule("2bw", 2, 2, 3)).splitlines()[1].split("|")[1].split()
    fs = [c for c in cells if c.startswith("F")]
    assert fs == ["F0v0", "F1v0", "F2v1", "F3v1", "F4v0", "F5v0"]
    assert "." not in cells[1:cells.index("S1")]


# ---- validity sweep -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_validate_sweep(kind):
    for d in range(1, 7):
        for m in _ms(kind, d):
            for T in range(1, 6):
                for t0 in (0, 3):
                    res = validate(make_schedule(kind, d, m, T, t0))
                    # unit F=1, B=2, nothing else takes time: a flushing schedule fills and
                    # drains the pipeline (d - 1 microbatch slots) every batch, 2bw once
                    slots = T * m + d - 1 if kind == "2bw" else T * (m + d - 1)
                    assert res.makespan == 3 * slots, (kind, d, m, T, t0)
                    assert res.busy == [3 * T * m] * d
                    assert res.bubble_fraction == pytest.approx([1 - T * m / slots] * d, abs=1e-12)


def test_validate_with_costs_and_latency():
    durations = lambda stage, a: {"F": 1.0 + 0.1 * stage, "B": 2.5, "S": 0.3}.get(a.kind, 0.1)
    for kind in KINDS:
        res = simulate(make_schedule(kind, 4, 5, 3, 1), durations, comm_latency=0.25)
        assert res.busy[0] > 0 and res.makespan > max(res.busy)


def test_forward_only():
    res = validate(forward_only(3, 5))
    assert res.schedule.name == "forward"
    assert [len(acts) for acts in res.schedule.table()] == [10, 15, 10]
    assert res.makespan == 5 + 2  # unit forwards, fill of d-1
    with pytest.raises(ScheduleError, match="forward-only"):
        tbl = forward_only(2, 2).table()
        tbl[1].append(A.B(0, 0))
        simulate(forward_only(2, 2).with_table(tbl))


def test_bubble_ordering():
    bub = {k: simulate(make_schedule(k, 4, 8, 4)).bubble for k in KINDS}
    assert bub["2bw"] < bub["flush"] == pytest.approx(bub["gpipe"])
    assert bub["flush"] == pytest.approx(3 / 11)  # (d-1)/(m+d-1)


# ---- semantics of the Schedule object -------------------------------------------------------


def test_weight_versions():
    s = make_schedule("2bw", 2, 2, 4)
    assert s.num_slots == 2 and s.initial_slot_weights() == [0, 0]
    assert [s.weight_of_batch(t) for t in range(4)] == [0, 0, 1, 2]
    assert [s.slot_of_batch(t) for t in range(4)] == [0, 1, 0, 1]
    assert make_schedule("2bw", 2, 2, 4, first_batch=3).initial_slot_weights() == [3, 2]
    assert make_schedule("2bw", 2, 2, 4, first_batch=4).initial_slot_weights() == [3, 4]
    f = make_schedule("flush", 2, 2, 4, first_batch=5)
    assert f.num_slots == 1 and f.initial_slot_weights() == [5] and f.weight_of_batch(6) == 6
    # final slots: W(t0+T) is the newest, W(t0+T-1) the other one
    res = validate(make_schedule("2bw", 3, 3, 5, first_batch=3))
    assert all(sorted(w) == [7, 8] for w in res.slot_weights)


def test_lazy_windows_match_full_table():
    for kind in KINDS:
        for d in range(1, 6):
            for m in range(d, 2 * d + 2):
                for T in range(1, 10):
                    for t0 in (0, 3):
                        s = make_schedule(kind, d, m, T, t0)
                        full = generate_table(kind, d, m, T, t0)
                        for st in range(d):
                            wins = split_windows(full[st], t0, T)
                            got = [s.window(st, t) for t in range(t0, t0 + T)]
                            assert got == wins, (kind, d, m, T, t0, st)


def test_huge_segment_windows_are_cheap():
    s = make_schedule("2bw", 4, 6, num_batches=10**6, first_batch=3)
    last = s.window(2, 10**6 + 2)
    assert str(last[-1]) == f"S{10**6 + 2}"
    mid = s.window(2, 500_000)
    assert {a.batch for a in mid if a.batch >= 0} == {500_000}
    assert {a.version for a in mid if a.is_compute} == {0, 1}


def test_windows_are_self_contained_2bw():
    s = make_schedule("2bw", 4, 4, 3)
    for st in range(4):
        w0 = s.window(st, 0)
        assert str(w0[-1]) == "S0" and [str(a) for a in w0].count("R0") == 1
        # after S0 the next forward is the first of batch 2 (the first to need W(1))
        nxt = [a for a in s.window(st, 1) if a.kind == "F"][0]
        assert nxt.mb == 8 and nxt.version == 0


def test_peak_in_flight():
    for d in (2, 4, 5):
        for m in (d, d + 3):
            g = simulate(make_schedule("gpipe", d, m, 2))
            assert g.peak_in_flight == [m] * d
            for kind in ("flush", "2bw"):
                res = simulate(make_schedule(kind, d, m, 3))
                assert res.peak_in_flight == [d - s for s in range(d)]
    # a custom table is counted: stage 1 of this flush table runs both forwards first
    tbl = make_schedule("flush", 2, 2).table()
    tbl[1] = [A.RA(0), A.F(0, 0), A.RA(1), A.F(1, 0), A.B(0, 0), A.SG(0), A.B(1, 0), A.SG(1),
              A.R(0), A.N(0), A.S(0)]
    assert simulate(make_schedule("flush", 2, 2).with_table(tbl)).peak_in_flight == [2, 2]


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"m=2 < d=4.*--global-batch-size"):
        make_schedule("2bw", 4, 2)
    with pytest.raises(ValueError, match="valid schedules: 2bw, flush, gpipe$"):
        make_schedule("pipedream", 4, 4)
    for args in ((0, 4), (2, 0), (2, 2, 0), (2, 2, 1, -1)):
        with pytest.raises(ValueError):
            make_schedule("flush", *args)


def test_action_round_trip():
    for text in ("F3v0", "B12v1", "ra3", "sa0", "rg7", "sg2", "R2", "N0", "S11"):
        assert str(A.parse(text)) == text
    for kind in KINDS:
        for acts in make_schedule(kind, 3, 4, 2, 1).table():
            assert [A.parse(str(a)) for a in acts] == acts
    assert A.F(3, 0).label(1) == "1F3v0"


# ---- hand-broken tables ---------------------------------------------------------------------


def _broken(kind, d, m, T, edit):
    s = make_schedule(kind, d, m, T)
    tbl = s.table()
    edit(tbl)
    with pytest.raises(ScheduleError) as info:
        simulate(s.with_table(tbl))
    msg = str(info.value)
    assert "\n" not in msg and info.value.grid
    return msg, tbl


def test_reject_sa_before_f():
    def edit(t):
        i = t[0].index(A.F(1, 0))
        t[0][i], t[0][i + 1] = t[0][i + 1], t[0][i]
    msg, t = _broken("flush", 3, 4, 1, edit)
    step = t[0].index(A.SA(1))
    assert msg.startswith(f"stage 0 step {step} (0sa1): ") and "before its forward" in msg


def test_reject_missing_ra():
    msg, t = _broken("flush", 3, 4, 1, lambda t: t[1].remove(A.RA(2)))
    step = t[1].index(A.F(2, 0))
    assert msg.startswith(f"stage 1 step {step} (1F2v0): ") and "activation" in msg


def test_reject_wrong_version():
    def edit(t):
        i = t[2].index(A.F(5, 1))
        t[2][i] = A.F(5, 0)
    msg, t = _broken("2bw", 3, 3, 3, edit)
    step = t[2].index(A.F(5, 0))
    assert msg.startswith(f"stage 2 step {step} (2F5v0): ") and "slot 1" in msg


def test_reject_step_before_last_backward():
    def edit(t):
        t[1].remove(A.S(0))
        t[1].insert(t[1].index(A.B(3, 0)), A.S(0))
    msg, t = _broken("flush", 2, 4, 2, edit)
    assert msg == (f"stage 1 step {t[1].index(A.S(0))} (1S0): "
                   f"optimizer step of batch 0 before all its backwards (3 of 4 done)")


def test_reject_backward_before_forward():
    def edit(t):
        i = t[3].index(A.F(2, 0))
        j = t[3].index(A.B(2, 0))
        t[3][i], t[3][j] = t[3][j], t[3][i]
    msg, t = _broken("flush", 4, 4, 1, edit)
    step = t[3].index(A.B(2, 0))
    assert msg == f"stage 3 step {step} (3B2v0): backward before forward of microbatch 2"


def test_reject_cross_window_pair():
    # 2bw stage 0: move S(0) before the sa/rg group that closes window 0; their partners on
    # stage 1 stay in window 0.
    def edit(t):
        t[0].remove(A.S(0))
        t[0].insert(t[0].index(A.F(7, 1)) + 1, A.S(0))
    msg, t = _broken("2bw", 2, 4, 3, edit)
    hit = re.match(r"stage (\d) step (\d+) \((\d\w+)\): posted in window (\d) but its partner "
                   r"\d\w+ \(stage \d step \d+\) is in window (\d)", msg)
    assert hit, msg
    stage, step, label, w1, w2 = hit.groups()
    assert t[int(stage)][int(step)].label(int(stage)) == label and w1 != w2


def test_reject_fifo_mismatch():
    def edit(t):
        i, j = t[1].index(A.RA(0)), t[1].index(A.RA(1))
        t[1][i], t[1][j] = A.RA(1), A.RA(0)
    msg, t = _broken("gpipe", 2, 3, 1, edit)
    assert msg.startswith("stage 0 step 1 (0sa0): paired FIFO with 1ra1 (stage 1 step 0): microbatch 0 != 1")


def test_reject_deadlock():
    def edit(t):
        t[0].remove(A.RG(1))
        t[0].insert(0, A.RG(1))
    msg, _ = _broken("gpipe", 2, 2, 1, edit)
    assert msg.startswith("deadlock: ")
    assert "stage 0 step 0 (0rg1) waits for 1sg1" in msg
    assert "stage 1 step 0 (1ra0) waits for 0sa0" in msg


def test_reject_collective_deadlock():
    # stage 1 waits for the first activation of batch 1 before its R0/N0; stage 0 sends it only
    # after S0, which needs tied(0)/norm(0) from stage 1: a cycle through the collectives.
    def edit(t):
        t[1].remove(A.RA(1))
        t[1].insert(t[1].index(A.R(0)), A.RA(1))
    msg, t = _broken("flush", 2, 1, 2, edit)
    assert msg.startswith("deadlock: ")
    assert f"stage 0 step {t[0].index(A.N(0))} (0N0) waits for tied(0) from stage 1" in msg
    assert f"stage 1 step {t[1].index(A.RA(1))} (1ra1) waits for 0sa1" in msg


def test_reject_missing_backward_at_end():
    def edit(t):
        t[1] = [a for a in t[1] if a not in (A.B(3, 0), A.SG(3))]
        t[0] = [a for a in t[0] if a not in (A.B(3, 0), A.RG(3))]
    msg, _ = _broken("gpipe", 2, 4, 1, edit)
    assert "before all its backwards (3 of 4 done)" in msg


def test_bare_table_semantics_are_guessed():
    tbl = make_schedule("2bw", 3, 3, 2).table()
    s = Schedule.from_table(tbl)
    assert (s.name, s.num_microbatches, s.num_batches) == ("2bw", 3, 2)
    assert simulate(tbl).makespan == simulate(make_schedule("2bw", 3, 3, 2)).makespan
