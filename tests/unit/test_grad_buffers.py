"""Issue 32, first step: 2BW with one fp32 gradient buffer per stage (`--2bw-grad-buffers 1`,
opt-in; the default keeps one per weight version). The kind's tables place S(t) before every
stage's first backward of batch t+1; the validator rejects a table that does not; the simulator
charges the wait; the memory model counts the buffers the engine's weights hold, to the byte."""
import itertools

import pytest
import torch

from megatron_2bw.config.build import build_config
from megatron_2bw.config.choices import ConfigError
from megatron_2bw.config.control_flags import TAIL
from megatron_2bw.planner.memory import state_bytes
from megatron_2bw.pipeline.weights import VersionedWeights
from megatron_2bw.pretrain import build_parser
from megatron_2bw.schedule.actions import BACKWARD, NORM, REDUCE, STEP
from megatron_2bw.schedule.kinds import TwoBWOneBuffer, schedule_kind, schedule_kind_of
from megatron_2bw.schedule.nccl_order import early_receives_safe
from megatron_2bw.schedule.nccl_posts import CommLayout
from megatron_2bw.schedule.simulate import ScheduleError, simulate
from megatron_2bw.schedule.tables import Schedule, make_schedule

TWO_BW = schedule_kind("2bw")
ONE = schedule_kind_of("2bw", 1)


def _positions(acts):
    """(kind, batch or microbatch) -> index in one stage's list."""
    return {(a.kind, a.batch if a.kind in (REDUCE, NORM, STEP) else a.mb): i
            for i, a in enumerate(acts)}


def test_the_kinds_say_how_many_gradient_buffers():
    assert TWO_BW.grad_buffers == 2 and schedule_kind_of("2bw") is TWO_BW
    assert schedule_kind_of("2bw", 2) is TWO_BW and schedule_kind_of("flush", 1).grad_buffers == 1
    assert isinstance(ONE, TwoBWOneBuffer) and ONE is schedule_kind_of("2bw", 1)
    assert ONE.name == "2bw" and ONE.num_slots == 2 and ONE.grad_buffers == 1
    assert ONE.with_grad_buffers(2) is TWO_BW and ONE.with_grad_buffers(1) is ONE
    assert [ONE.grad_buffer_of_batch(t) for t in range(4)] == [0, 0, 0, 0]
    assert [TWO_BW.grad_buffer_of_batch(t) for t in range(4)] == [0, 1, 0, 1]
    # same versions and steps as 2BW: only the table's placement of S differs
    for t in range(5):
        assert (ONE.slot_of_batch(t), ONE.weight_of_batch(t), ONE.step_writes_slot(t)) == \
            (TWO_BW.slot_of_batch(t), TWO_BW.weight_of_batch(t), TWO_BW.step_writes_slot(t))
    with pytest.raises(ValueError, match="--2bw-grad-buffers must be one of 2, 1, first, got 3"):
        schedule_kind_of("2bw", 3)
    with pytest.raises(ValueError, match="does not apply to --pipeline-schedule flush"):
        schedule_kind_of("flush", 2)


CASES = [(d, m, T, t0) for d in range(1, 6) for m in range(d, d + 3) for T in (1, 2, 5)
         for t0 in (0, 1, 2, 3)]


def test_one_buffer_tables_step_before_the_first_backward_of_the_next_batch():
    for d, m, T, t0 in CASES:
        sched = Schedule(ONE, d, m, T, t0)
        simulate(sched)  # valid: the validator checks the buffer rule among the others
        for s in range(d):
            pos = _positions(sched.actions(s))
            for t in range(t0, t0 + T - 1):
                first_b = pos[(BACKWARD, (t + 1) * m)]
                assert pos[(REDUCE, t)] < pos[(NORM, t)] < pos[(STEP, t)] < first_b, (d, m, s, t)
        # long segments are translated windows of the 4-batch table
        assert make_schedule(ONE, d, m, 9, t0).table() == \
            [ONE.stage_actions(s, d, m, 9, t0) for s in range(d)]


def test_the_default_2bw_table_is_today_s_and_steps_later():
    """Today's table (S(t) after B((t+1)m + s)) is what the default kind still generates; it
    breaks the one-buffer rule, so the validator rejects it under the one-buffer kind."""
    for d, m in ((2, 2), (4, 4), (3, 5)):
        acts = TWO_BW.stage_actions(0, d, m, 3, 0)
        pos = _positions(acts)
        assert pos[(STEP, 0)] > pos[(BACKWARD, m)]  # the overlap the second buffer buys
        today = Schedule(TWO_BW, d, m, 3)
        simulate(today)
        with pytest.raises(ScheduleError, match=r"accumulates into gradient buffer 0 before S0 "
                                                r"consumed batch 0's gradient there \(1 buffer "):
            simulate(Schedule(ONE, d, m, 3, table=today.table()))


def test_a_planted_step_after_the_next_batch_s_backward_fails():
    d, m = 2, 3
    table = Schedule(ONE, d, m, 3).table()
    acts = table[1]
    pos = _positions(acts)
    step = acts.pop(pos[(STEP, 0)])
    acts.insert(_positions(acts)[(BACKWARD, m)] + 1, step)  # S0 right after B3
    with pytest.raises(ScheduleError, match=r"stage 1 step \d+ \(1B3v1\): backward of "
                                            r"microbatch 3 \(batch 1\) accumulates"):
        simulate(Schedule(ONE, d, m, 3, table=table))
    simulate(Schedule(TWO_BW, d, m, 3, table=table))  # two buffers: allowed


def test_the_simulator_charges_the_wait_for_the_step():
    """One buffer: every stage waits for N(t) (stage 0 posts it last) before its first backward
    of batch t+1, so the steady state is longer than 2BW's; d = 1 has nothing to wait for."""
    for d, m in ((2, 2), (4, 4), (4, 8)):
        one, two = (simulate(Schedule(k, d, m, 4)).makespan for k in (ONE, TWO_BW))
        assert one > two, (d, m, one, two)
    assert simulate(Schedule(ONE, 1, 2, 4)).makespan == simulate(Schedule(TWO_BW, 1, 2, 4)).makespan


def comm_cases(d):
    """(CommLayout, m, t0): tensor, data, distributed optimizer, compensation and phase."""
    for t, w, sharded, comp in itertools.product((1, 2), (1, 2), (False, True), (False, True)):
        if sharded and w == 1:
            continue
        layout = CommLayout(tensor=t, data=w, distributed_optimizer=sharded, compensation=comp,
                            views=sharded or comp, sequence_parallel=t > 1, tied=True)
        for m, t0 in itertools.product((d, d + 1), (0, 2)):
            yield layout, m, t0


@pytest.mark.parametrize("d", [2, 4])
def test_one_buffer_tables_are_nccl_safe(d):
    for layout, m, t0 in comm_cases(d):
        assert early_receives_safe(make_schedule(ONE, d, m, 10 ** 9, t0), layout)


def _stage():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.LayerNorm(6), torch.nn.Linear(6, 3))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("grad_buffers", [None, 1])
def test_the_memory_model_counts_the_weights_buffers(dtype, grad_buffers):
    w = VersionedWeights(_stage(), 2, dtype, "cpu", grad_buffers=grad_buffers)
    held = sum(t.numel() * t.element_size() for t in w.held_grads())
    model = state_bytes(w.numel, 2, dtype, "adam", grad_buffers=grad_buffers)
    assert held == model["grads"]
    if grad_buffers == 1:
        assert model["grads"] == (w.numel + TAIL) * 4 + 2 * 4  # one buffer + each slot's loss
        assert w.grads[0] is w.grads[1] and w.separate_losses
        assert state_bytes(w.numel, 2, dtype, "adam")["grads"] - model["grads"] == \
            (w.numel + TAIL) * 4 - 2 * 4
    else:
        assert model == state_bytes(w.numel, 2, dtype, "adam")  # the default: today's
        assert w.grads[0] is not w.grads[1] and not w.separate_losses
        assert w.losses[1].data_ptr() == w.grads[1][w.numel:].data_ptr()  # today's tail
    if dtype == "fp32":  # both modules' .grad views point into their slot's buffer
        for k in (0, 1):
            ptrs = {p.grad.untyped_storage().data_ptr() for p in w.modules[k].parameters()}
            assert ptrs == {w.grads[k].untyped_storage().data_ptr()}


def test_the_loss_of_the_next_batch_survives_the_step_s_zeroing():
    w = VersionedWeights(_stage(), 2, "fp32", "cpu", grad_buffers=1)
    n = w.numel
    w.losses[0].add_(0.5)
    w.take_loss(0)  # R(0)
    assert float(w.grads[0][n]) == 0.5 and float(w.losses[0]) == 0.0
    w.losses[1].add_(0.25)  # batch 1's forward on the last stage, before S(0)
    w.grads[0].zero_()  # S(0)
    w.take_loss(1)  # R(1)
    assert float(w.grads[1][n]) == 0.25
    with pytest.raises(ValueError, match="grad_buffers must be 1 or the 2 version slots"):
        VersionedWeights(_stage(), 2, "fp32", "cpu", grad_buffers=3)


BASE = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--pipeline-model-parallel-size", "2", "--global-batch-size", "2"]


def _built(argv, world=2):
    return build_config(build_parser("gpt").parse_args(BASE + argv), "gpt", world).config


def test_the_flag_picks_the_mode_and_bad_values_are_one_line_errors():
    assert _built([]).grad_buffers is None  # the default: today's two
    cfg = _built(["--2bw-grad-buffers", "1"])
    assert cfg.grad_buffers == 1 and cfg.schedule == "2bw"
    assert _built(["--2bw-grad-buffers", "2"]).grad_buffers == 2
    for argv, message in ((["--2bw-grad-buffers", "3"], "--2bw-grad-buffers must be one of 2, 1"),
                          (["--2bw-grad-buffers", "2", "--pipeline-schedule", "flush"],
                           "does not apply to --pipeline-schedule flush")):
        with pytest.raises(ConfigError) as e:
            _built(argv)
        assert message in str(e.value) and "\n" not in str(e.value)


def test_the_pre_launch_memory_check_counts_one_buffer():
    from megatron_2bw.config import BatchConfig, Config, ModelConfig, ParallelConfig
    from megatron_2bw.planner.memory_check import stage_estimates
    cfg = Config(model=ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=2,
                                   seq_length=16, vocab_size=512),
                 parallel=ParallelConfig(pipeline=2, data=1),
                 batch=BatchConfig(micro_batch_size=2, global_batch_size=8)).validate(2)
    two = stage_estimates(cfg, 2)
    one = stage_estimates(cfg.replace(grad_buffers=1).validate(2), 2)
    for a, b in zip(two, one):
        assert a["grads"] - b["grads"] == a["grads"] // 2 - 2 * 4  # a buffer, less 2 losses
        assert a["total"] - b["total"] == a["grads"] - b["grads"]
        assert {k: v for k, v in a.items() if k not in ("grads", "total")} == \
            {k: v for k, v in b.items() if k not in ("grads", "total")}
