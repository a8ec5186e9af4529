"""`deepspeed.runtime.pipe.schedule` as a view of our flush / forward tables: the instruction
streams equal the real DeepSpeed's for every size its tests use (and more), and hold on their
own: step counts, matched sends and receives, buffers, the 1F1B order of our table."""
import pytest

from megatron_2bw.deepspeed.runtime.pipe import schedule as view
from megatron_2bw.schedule.actions import BACKWARD, FORWARD
from megatron_2bw.schedule.kinds import schedule_kind

from test_deepspeed_config import deepspeed_module  # noqa: E402

SIZES = [(d, m) for d in (1, 2, 3, 4, 5) for m in (1, 2, 3, 4, 8, 10)]


def _streams(module, cls, m, d):
    return [[[repr(i) for i in step] for step in getattr(module, cls)(m, d, s)]
            for s in range(d)]


@pytest.mark.parametrize("cls", ["TrainSchedule", "InferenceSchedule"])
def test_streams_equal_real_deepspeed(cls):
    real = deepspeed_module("deepspeed.runtime.pipe.schedule")
    for d, m in SIZES:
        assert _streams(view, cls, m, d) == _streams(real, cls, m, d), (cls, d, m)
        for s in range(d):
            assert (getattr(view, cls)(m, d, s).num_pipe_buffers()
                    == getattr(real, cls)(m, d, s).num_pipe_buffers()), (cls, d, m, s)


def _kinds(step):
    return [type(i).__name__ for i in step]


@pytest.mark.parametrize("d,m", SIZES)
def test_train_grid_lengths_loads_and_the_step_at_the_end(d, m):
    for s in range(d):
        sched = view.TrainSchedule(micro_batches=m, stages=d, stage_id=s)
        steps = list(sched)
        assert len(steps) == 2 * (m + d - 1) and list(sched) == steps   # iterable again
        flat = [k for step in steps for k in _kinds(step)]
        assert flat.count("ForwardPass") == flat.count("BackwardPass") == m
        assert flat.count("LoadMicroBatch") == (m if s in (0, d - 1) else 0)
        assert _kinds(steps[-1])[-3:] == ["ReduceTiedGrads", "ReduceGrads", "OptimizerStep"]
        assert flat.count("OptimizerStep") == 1
        if s == 0:
            assert "SendGrad" not in flat and "RecvActivation" not in flat
        if s == d - 1:
            assert "SendActivation" not in flat and "RecvGrad" not in flat
        for step in steps:
            for i in step:
                if isinstance(i, view.BufferOpInstruction):
                    assert 0 <= i.buffer_id < sched.num_pipe_buffers()


@pytest.mark.parametrize("cls", ["TrainSchedule", "InferenceSchedule"])
@pytest.mark.parametrize("d,m", [(2, 1), (3, 4), (4, 8), (5, 3)])
def test_every_send_meets_the_neighbours_receive_on_the_same_step(cls, d, m):
    grids = [list(getattr(view, cls)(m, d, s)) for s in range(d)]
    pairs = {"SendActivation": ("RecvActivation", 1), "SendGrad": ("RecvGrad", -1)}
    for s, steps in enumerate(grids):
        for t, step in enumerate(steps):
            for name, (match, hop) in pairs.items():
                sends = _kinds(step).count(name)
                if sends:
                    assert 0 <= s + hop < d and _kinds(grids[s + hop][t]).count(match) == sends
    total = {name: sum(_kinds(step).count(name) for steps in grids for step in steps)
             for name in ("SendActivation", "RecvActivation", "SendGrad", "RecvGrad")}
    assert total["SendActivation"] == total["RecvActivation"] == (d - 1) * m
    assert total["SendGrad"] == total["RecvGrad"] == ((d - 1) * m if cls == "TrainSchedule" else 0)


@pytest.mark.parametrize("d,m", [(1, 4), (3, 2), (4, 8)])
def test_compute_order_is_our_flush_table(d, m):
    for s in range(d):
        sched = view.TrainSchedule(m, d, s)
        table = schedule_kind("flush").stage_actions(s, d, m, 1, 0)
        ours = [("F" if a.kind == FORWARD else "B", a.mb % sched.num_pipe_buffers())
                for a in table if a.kind in (FORWARD, BACKWARD)]
        shown = [("F" if isinstance(i, view.ForwardPass) else "B", i.buffer_id)
                 for step in sched for i in step
                 if isinstance(i, (view.ForwardPass, view.BackwardPass))]
        assert shown == ours


def test_single_stage_and_stage_queries():
    steps = list(view.TrainSchedule(micro_batches=3, stages=1, stage_id=0))
    assert [_kinds(s) for s in steps[:2]] == [["LoadMicroBatch", "ForwardPass"],
                                              ["BackwardPass"]]
    assert _kinds(steps[-1]) == ["BackwardPass", "ReduceTiedGrads", "ReduceGrads",
                                 "OptimizerStep"]
    inference = list(view.InferenceSchedule(micro_batches=3, stages=1, stage_id=0))
    assert [_kinds(s) for s in inference] == [["LoadMicroBatch", "ForwardPass"]] * 3
    mid = view.TrainSchedule(micro_batches=4, stages=3, stage_id=1)
    assert (mid.is_first_stage, mid.is_last_stage, mid.stage, mid.num_stages,
            mid.num_micro_batches) == (False, False, 1, 3, 4)
    assert view.TrainSchedule(4, 3, 2).is_last_stage and view.TrainSchedule(4, 3, 0).is_first_stage
    assert repr(view.SendGrad(buffer_id=1)) == "SendGrad(buffer_id=1)"
    assert view.ForwardPass(0) == view.ForwardPass(buffer_id=0) != view.BackwardPass(0)


def test_inference_first_stage_sends_the_step_after_each_forward():
    m, d = 3, 3
    steps = [_kinds(s) for s in view.InferenceSchedule(m, d, 0)]
    assert steps[0] == ["LoadMicroBatch", "ForwardPass"]
    assert steps[1] == ["LoadMicroBatch", "SendActivation", "ForwardPass"]
    assert steps[m] == ["SendActivation"] and steps[m + 1:] == [[]] * (d - 2)
