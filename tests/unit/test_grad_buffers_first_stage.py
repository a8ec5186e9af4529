"""Issue 32: 2BW with one fp32 gradient buffer on the first stage and two on the others
(`--2bw-grad-buffers first`). Stage 0 keeps the most microbatches in flight (d) and posts N(t)
last, so a step right before its first backward of batch t+1 waits for that all-reduce's latency
only: the tables are valid, the other stages' are 2BW's, the simulator times them as 2BW's,
the NCCL-order proof is 2BW's, the validator holds stage 0 to one buffer, the engine's weights
and the memory model hold one buffer on stage 0 and two elsewhere, to the byte."""
import pytest
import torch

from megatron_2bw.config.control_flags import TAIL
from megatron_2bw.planner.memory import state_bytes
from megatron_2bw.schedule.actions import BACKWARD, NORM, REDUCE, STEP
from megatron_2bw.schedule.kinds import (FIRST_STAGE, TwoBWFirstStageOneBuffer, schedule_kind,
                                         schedule_kind_of)
from megatron_2bw.schedule.nccl_order import early_receives_safe
from test_grad_buffers import comm_cases
from megatron_2bw.schedule.simulate import ScheduleError, simulate
from megatron_2bw.schedule.tables import Schedule, make_schedule

TWO_BW = schedule_kind("2bw")
FIRST = schedule_kind_of("2bw", FIRST_STAGE)
CASES = [(d, m, T, t0) for d in range(1, 6) for m in range(d, d + 3) for T in (1, 2, 5)
         for t0 in (0, 1, 2, 3)]


def _positions(acts):
    return {(a.kind, a.batch if a.kind in (REDUCE, NORM, STEP) else a.mb): i
            for i, a in enumerate(acts)}


def test_the_kind_holds_one_buffer_on_stage_0_only():
    assert isinstance(FIRST, TwoBWFirstStageOneBuffer) and FIRST.name == "2bw"
    assert [FIRST.grad_buffers_of(s) for s in range(4)] == [1, 2, 2, 2]
    assert FIRST.with_grad_buffers(2) is TWO_BW and FIRST.with_grad_buffers(FIRST_STAGE) is FIRST
    assert [FIRST.grad_buffer_of_batch(t, 0) for t in range(4)] == [0, 0, 0, 0]
    assert [FIRST.grad_buffer_of_batch(t, 1) for t in range(4)] == [0, 1, 0, 1]
    for t in range(5):
        assert (FIRST.slot_of_batch(t), FIRST.weight_of_batch(t), FIRST.step_writes_slot(t)) == \
            (TWO_BW.slot_of_batch(t), TWO_BW.weight_of_batch(t), TWO_BW.step_writes_slot(t))
    with pytest.raises(ValueError, match="does not apply to --pipeline-schedule flush"):
        schedule_kind_of("flush", FIRST_STAGE)


def test_stage_0_steps_right_before_its_first_backward_and_the_others_run_2bw():
    for d, m, T, t0 in CASES:
        sched = Schedule(FIRST, d, m, T, t0)
        simulate(sched)  # valid: windows, deadlocks, versions and stage 0's one-buffer rule
        acts = sched.actions(0)
        pos = _positions(acts)
        for t in range(t0, t0 + T - 1):
            b = pos[(BACKWARD, (t + 1) * m)]
            assert pos[(REDUCE, t)] < pos[(NORM, t)] < pos[(STEP, t)] == b - 1, (d, m, t)
        for s in range(1, d):
            assert sched.actions(s) == Schedule(TWO_BW, d, m, T, t0).actions(s)
        assert make_schedule(FIRST, d, m, 9, t0).table() == \
            [FIRST.stage_actions(s, d, m, 9, t0) for s in range(d)]


def test_the_validator_holds_stage_0_to_its_one_buffer():
    for d, m in ((2, 2), (3, 4), (4, 4)):
        today = Schedule(TWO_BW, d, m, 3).table()  # stage 0 steps after B(m)
        with pytest.raises(ScheduleError, match=r"stage 0 step \d+ .*accumulates into gradient "
                                                r"buffer 0 before S0 consumed"):
            simulate(Schedule(FIRST, d, m, 3, table=today))
        mixed = [Schedule(FIRST, d, m, 3).actions(0)] + today[1:]
        simulate(Schedule(FIRST, d, m, 3, table=mixed))


def test_the_simulator_times_it_as_2bw():
    for d, m in ((2, 2), (2, 8), (4, 4), (4, 8), (8, 8)):
        for latency in (0.0, 0.05):
            first, two = (simulate(Schedule(k, d, m, 5), comm_latency=latency).makespan
                          for k in (FIRST, TWO_BW))
            assert first == pytest.approx(two), (d, m, latency)


@pytest.mark.parametrize("d", [2, 4])
def test_early_receives_are_as_safe_as_2bw_s(d):
    for layout, m, t0 in comm_cases(d):
        assert early_receives_safe(Schedule(FIRST, d, m, 10 ** 9, t0), layout) == \
            early_receives_safe(Schedule(TWO_BW, d, m, 10 ** 9, t0), layout)


def test_weights_and_memory_model_hold_one_buffer_on_stage_0():
    from megatron_2bw.pipeline.weights import VersionedWeights
    for stage, g in ((0, 1), (1, 2)):
        torch.manual_seed(0)
        w = VersionedWeights(torch.nn.Linear(8, 6), 2, "bf16", "cpu",
                             grad_buffers=FIRST.grad_buffers_of(stage))
        held = sum(t.numel() * t.element_size() for t in w.held_grads())
        model = state_bytes(w.numel, 2, "bf16", "adam", grad_buffers=FIRST.grad_buffers_of(stage))
        assert held == model["grads"] == g * (w.numel + TAIL) * 4 + (2 * 4 if g == 1 else 0)
