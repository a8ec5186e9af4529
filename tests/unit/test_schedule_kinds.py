"""Every rule a schedule kind states (schedule/kinds.py) holds in the kind's own tables, and the
validator's verdict is what the engine asks before running a window (simulate.check_schedule)."""
import pytest

from megatron_2bw.schedule import actions as A
from megatron_2bw.schedule import simulate as sim
from megatron_2bw.schedule.kinds import (DEFAULT_SCHEDULE, ScheduleKind, TwoBW, kind_with_slots,
                                         register_kind, schedule_kind, schedule_names)
from megatron_2bw.schedule.simulate import ScheduleError, check_schedule, simulate, validate
from megatron_2bw.schedule.tables import (Schedule, count_in_flight, forward_only, generate_table,
                                          make_schedule)

KINDS = schedule_names()


def _sizes(kind):
    for d in range(1, 6):
        for m in range(kind.min_microbatches(d), 2 * d + 2):
            yield d, m


def test_the_registry_lists_the_three_schedules_2bw_first():
    assert KINDS == ("2bw", "flush", "gpipe") and DEFAULT_SCHEDULE == "2bw"
    assert schedule_kind("forward").is_training is False
    with pytest.raises(ValueError, match=r"^unknown schedule 'pipedream'; valid schedules: "
                                         r"2bw, flush, gpipe$"):
        schedule_kind("pipedream")
    with pytest.raises(ValueError, match="already registered"):
        register_kind(TwoBW())
    assert kind_with_slots(1).name == "flush" and kind_with_slots(2).name == "2bw"


@pytest.mark.parametrize("name", KINDS)
def test_version_rules_follow_from_the_slot_count(name):
    k = schedule_kind(name)
    assert k.delay == k.num_slots - 1
    for t in range(12):
        assert k.slot_of_batch(t) == t % k.num_slots
        assert k.weight_of_batch(t) == max(t - k.delay, 0)
        # S(t) writes W(t+1) where the first batch that runs on it looks
        first = min(u for u in range(t + 1, t + 2 + k.num_slots) if k.weight_of_batch(u) == t + 1)
        assert k.step_writes_slot(t) == k.slot_of_batch(first)
    assert {"2bw": 2}.get(name, 1) == k.num_slots


@pytest.mark.parametrize("name", KINDS)
def test_slot_rules_hold_in_the_tables(name):
    """The validator replays the slots: every F/B of batch t on slot_of_batch(t) holding
    W(weight_of_batch(t)), every S(t) writing step_writes_slot(t); after the segment the newest
    slot holds the newest weights."""
    k = schedule_kind(name)
    for d, m in _sizes(k):
        for T in (1, 2, 5):
            for t0 in (0, 1, 4):
                res = validate(make_schedule(k, d, m, T, t0))
                for slots in res.slot_weights:
                    assert slots[k.newest_slot(t0 + T)] == t0 + T
                assert k.initial_slot_weights(t0)[k.newest_slot(t0)] == t0


@pytest.mark.parametrize("name", KINDS)
def test_in_flight_and_flushes_hold_in_the_tables(name):
    k = schedule_kind(name)
    for d, m in _sizes(k):
        for T in (1, 3):
            table = generate_table(k, d, m, T)
            assert [count_in_flight(acts) for acts in table] == \
                [k.in_flight(d, m, s) for s in range(d)], (name, d, m, T)
            # flushes: no forward of batch t+1 before S(t) on any stage
            ahead = False
            for acts in table:
                steps = 0
                for a in acts:
                    steps += a.kind == A.STEP
                    ahead |= a.kind == A.FORWARD and a.mb // m > steps
            assert ahead == (not k.flushes and T > 1), (name, d, m, T)


@pytest.mark.parametrize("name", KINDS)
def test_forwards_between_reduce_and_norm_hold_in_the_tables(name):
    k = schedule_kind(name)
    for d, m in _sizes(k):
        T = 4
        table = generate_table(k, d, m, T)
        for acts in table:
            labels = [str(a) for a in acts]
            for t in range(T - 1):  # the last batch has no next batch to overlap with
                between = labels[labels.index(f"R{t}"):labels.index(f"N{t}")]
                assert sum(x.startswith("F") for x in between) == \
                    k.forwards_between_reduce_and_norm, (name, d, m, t)


@pytest.mark.parametrize("name", KINDS)
def test_segments_measure_the_steady_state(name):
    k = schedule_kind(name)
    for d, m in _sizes(k):
        a, b = (simulate(make_schedule(k, d, m, T)).makespan for T in k.segments)
        steady = 3 * m if name == "2bw" else 3 * (m + d - 1)  # unit F=1, B=2
        assert b - a == simulate(make_schedule(k, d, m, 8)).makespan - \
            simulate(make_schedule(k, d, m, 7)).makespan == steady


def test_2bw_needs_as_many_microbatches_as_stages():
    k = schedule_kind("2bw")
    assert [k.min_microbatches(d) for d in (1, 4)] == [1, 4]
    assert k.microbatch_error(4, 3, "fix it") == ("2bw needs at least as many microbatches per "
                                                  "batch as pipeline stages (m=3 < d=4): fix it")
    assert k.microbatch_error(4, 4) is None and k.accepts(4, 4) and not k.accepts(4, 3)
    with pytest.raises(ValueError, match=r"m=3 < d=4"):
        generate_table(k, 4, 3)

    class Loose(TwoBW):  # the same tables without the minimum: they break
        name = "loose-2bw"

        def min_microbatches(self, d):
            return 1

    for d in range(2, 6):
        for m in range(1, d):
            with pytest.raises(ScheduleError):
                validate(Schedule(Loose(), d, m, 3))


def test_a_new_kind_is_asked_not_named():
    """A kind the registry has never seen runs through the validator on its own rules: 2BW's
    table with three versions (batch t on W(t-2)) is valid, with one it is not."""

    class ThreeSlots(TwoBW):
        name = "three"
        num_slots = 3

    class OneSlot(TwoBW):
        name = "one"
        num_slots = 1

    k = schedule_kind(ThreeSlots())
    assert isinstance(k, ScheduleKind) and k.delay == 2 and not k.flushes
    res = validate(Schedule(k, 3, 4, 6, first_batch=2))
    assert all(sorted(w) == [6, 7, 8] for w in res.slot_weights)
    with pytest.raises(ScheduleError, match=r"slot 0 holds W\(0\) but batch 1 needs W\(1\)"):
        validate(Schedule(OneSlot(), 3, 4, 3))  # one version: batch 1 cannot wait for S(0)


# ---- the engine's check: the validator's verdict, cached per shape -----------------------------


def test_check_schedule_validates_once_per_shape(monkeypatch):
    calls = []
    real = sim.validate
    monkeypatch.setattr(sim, "validate", lambda s: calls.append(s) or real(s))
    monkeypatch.setattr(sim, "_VERDICTS", {})
    for t0 in (0, 5, 7, 9):  # phases 0, 3, 3 (t0 >= 2, odd), 3
        check_schedule(make_schedule("2bw", 3, 4, num_batches=10 ** 9, first_batch=t0))
    check_schedule(forward_only(3, 4))
    check_schedule(forward_only(3, 4))
    assert len(calls) == 3
    assert all(c.num_batches <= 4 for c in calls)  # a huge segment validates its 4-batch table


def test_check_schedule_rejects_a_hand_broken_table_in_one_line():
    s = make_schedule("flush", 2, 2)
    tbl = s.table()
    tbl[1].remove(A.RA(1))
    broken = s.with_table(tbl)
    for _ in range(2):  # the second time from the cached verdict
        with pytest.raises(ScheduleError) as info:
            check_schedule(broken)
        msg = str(info.value)
        assert "\n" not in msg and info.value.grid
        assert msg.startswith("Schedule('flush', num_stages=2, num_microbatches=2, num_batches=1, "
                              "first_batch=0, custom table) is not a valid schedule: stage 1 step ")
        assert "forward of microbatch 1 before its activation was received" in msg
