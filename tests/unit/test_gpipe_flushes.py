"""GPipe in flushes (`--gpipe-microbatches-per-flush k`, issue 30 point 2: GPipe as it runs a
global batch whose m stashes do not fit, the paper's "the maximum number of microbatches it can
admit is small, leading to a larger pipeline bubble"): the kind, its tables (valid, NCCL-safe,
k in flight, one fill per flush), the flag, the pre-launch memory check, and the planner's
composed prediction, which equals simulating the whole table."""
import pytest

from megatron_2bw.config import BatchConfig, Config, ModelConfig, ParallelConfig
from megatron_2bw.config.build import build_config
from megatron_2bw.config.choices import ConfigError
from megatron_2bw.planner import AnalyticProfile, Topology
from megatron_2bw.planner.cost_model import LayerTimes, Layout, Setup, stage_plan
from megatron_2bw.planner.memory_check import stage_estimates
from megatron_2bw.planner.simulate import predict
from megatron_2bw.pretrain import build_parser
from megatron_2bw.schedule.kinds import GPipeInFlushes, schedule_kind, schedule_kind_of
from megatron_2bw.schedule.nccl_order import early_receives_safe
from megatron_2bw.schedule.simulate import format_grid, simulate, validate
from megatron_2bw.schedule.tables import count_in_flight, make_schedule
from test_grad_buffers import comm_cases

GPIPE = schedule_kind("gpipe")


def test_the_kind_is_gpipe_with_k_in_flight():
    k2 = GPIPE.with_microbatches_per_flush(2)
    assert isinstance(k2, GPipeInFlushes) and k2.name == "gpipe" and k2.stashes_logits
    assert k2 is schedule_kind_of("gpipe", None, 2)  # one object per k: schedules cache on it
    assert GPIPE.with_microbatches_per_flush(None) is GPIPE
    assert k2.with_microbatches_per_flush(None) is k2
    assert [k2.in_flight(4, m, 0) for m in (1, 2, 5)] == [1, 2, 2]
    for t in range(4):
        assert (k2.slot_of_batch(t), k2.weight_of_batch(t), k2.step_writes_slot(t)) == \
            (GPIPE.slot_of_batch(t), GPIPE.weight_of_batch(t), GPIPE.step_writes_slot(t))
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="must be a positive integer"):
            GPIPE.with_microbatches_per_flush(bad)
    for name in ("flush", "2bw"):
        with pytest.raises(ValueError, match="applies to --pipeline-schedule gpipe only"):
            schedule_kind_of(name, None, 2)


def test_the_table_runs_one_gpipe_flush_after_another_then_steps_once():
    rows = format_grid(make_schedule(schedule_kind_of("gpipe", None, 2), 2, 4)).splitlines()
    cells = [c for c in rows[0].split("|")[1].split() if c != "."]
    assert cells == ["F0v0", "F1v0", "B1v0", "B0v0", "F2v0", "F3v0", "B3v0", "B2v0", "S0"]


@pytest.mark.parametrize("d", [1, 2, 3, 5])
def test_tables_are_valid_hold_k_in_flight_and_fill_once_per_flush(d):
    for m in range(1, 9):
        for k in range(1, m + 1):
            kind = schedule_kind_of("gpipe", None, k)
            for T, t0 in ((1, 0), (3, 2)):
                sched = make_schedule(kind, d, m, T, t0)
                res = validate(sched)
                # unit F=1, B=2: each flush of x microbatches takes x + d - 1 slots of 3
                flushes = [k] * (m // k) + ([m % k] if m % k else [])
                assert res.makespan == 3 * T * sum(x + d - 1 for x in flushes), (d, m, k, T)
                assert res.busy == [3 * T * m] * d
                assert res.slot_weights == simulate(make_schedule(GPIPE, d, m, T, t0)).slot_weights
                for s in range(d):
                    assert count_in_flight(sched.actions(s)) == min(k, m) == sched.peak_in_flight(s)


@pytest.mark.parametrize("d", [2, 4])
def test_tables_are_nccl_safe(d):
    for layout, m, t0 in comm_cases(d):
        for k in (1, 2, m - 1):
            assert early_receives_safe(make_schedule(schedule_kind_of("gpipe", None, k), d,
                                                     m + 2, 10 ** 9, t0), layout)


BASE = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--pipeline-model-parallel-size", "2", "--global-batch-size", "8"]


def _built(argv, world=2):
    return build_config(build_parser("gpt").parse_args(BASE + argv), "gpt", world).config


def test_the_flag_sets_the_kind_and_bad_values_are_one_line_errors():
    assert _built(["--pipeline-schedule", "gpipe"]).microbatches_per_flush is None
    cfg = _built(["--pipeline-schedule", "gpipe", "--gpipe-microbatches-per-flush", "3"])
    assert cfg.microbatches_per_flush == 3 and cfg.schedule == "gpipe"
    for argv, message in (
            (["--pipeline-schedule", "gpipe", "--gpipe-microbatches-per-flush", "0"],
             "--gpipe-microbatches-per-flush must be a positive integer, got 0"),
            (["--gpipe-microbatches-per-flush", "2"],  # the default schedule at d=2: 2bw
             "--gpipe-microbatches-per-flush applies to --pipeline-schedule gpipe only, not 2bw"),
            (["--pipeline-schedule", "flush", "--gpipe-microbatches-per-flush", "2"],
             "not flush: drop it, or use --pipeline-schedule gpipe")):
        with pytest.raises(ConfigError) as e:
            _built(argv)
        assert message in str(e.value) and "\n" not in str(e.value)


def test_the_pre_launch_memory_check_counts_k_stashes():
    cfg = Config(model=ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=2,
                                   seq_length=16, vocab_size=512),
                 parallel=ParallelConfig(pipeline=2, data=1), schedule="gpipe",
                 batch=BatchConfig(micro_batch_size=2, global_batch_size=16)).validate(2)
    flush_of = {k: stage_estimates(cfg.replace(microbatches_per_flush=k).validate(2), 2)
                for k in (None, 1, 2, 4)}
    for s in range(2):
        act = {k: est[s]["activations"] for k, est in flush_of.items()}
        per_mb = act[2] - act[1]
        assert per_mb > 0 and act[4] - act[2] == 2 * per_mb and act[None] - act[4] == 4 * per_mb
        assert {n: v for n, v in flush_of[1][s].items() if n not in ("activations", "total")} \
            == {n: v for n, v in flush_of[None][s].items() if n not in ("activations", "total")}


@pytest.mark.parametrize("nodes,gpn,d,w,m,k", [
    (1, 4, 4, 1, 8, 3), (1, 4, 2, 2, 10, 4), (2, 2, 4, 1, 12, 5), (2, 4, 4, 2, 20, 6),
    (1, 2, 2, 1, 30, 4), (1, 4, 4, 1, 40, 16), (1, 4, 4, 1, 40, 12)])
def test_the_composed_prediction_equals_simulating_the_whole_table(nodes, gpn, d, w, m, k):
    """The planner times GPipe in flushes from one-flush GPipe increments (its flushes run one
    after another); the whole table simulated gives the same time, and the bound holds."""
    model = ModelConfig(num_layers=6, hidden_size=64, num_attention_heads=4, seq_length=32,
                        vocab_size=512)
    topo = Topology(num_nodes=nodes, gpus_per_node=gpn, gpu_memory_gb=1.0,
                    intra_node_bandwidth_gbps=100, inter_node_bandwidth_gbps=5)
    prof = AnalyticProfile(device_tflops=0.5, efficiency=0.5, memory_bandwidth_gb_per_s=20.0)
    setup = Setup(model, "fp32")
    plan = stage_plan(setup, Layout("gpipe", 1, d, w, 1, m, microbatches_per_flush=k),
                      LayerTimes(setup, prof, topo), topo)
    fast, full = predict(plan), predict(plan, full=True)
    assert fast.time_per_batch == pytest.approx(full.time_per_batch, rel=1e-9)
    assert plan.lower_bound() <= full.time_per_batch * (1 + 1e-12)
    one = stage_plan(setup, Layout("gpipe", 1, d, w, 1, m), LayerTimes(setup, prof, topo), topo)
    assert predict(one, full=True).time_per_batch < full.time_per_batch  # the fills it costs


def test_the_split_plan_equals_the_cost_models_plan_at_k():
    """The search's plan at k (the plan at k = 1 plus k - 1 stashes) is stage_plan's at k."""
    from megatron_2bw.planner.search import _fewer_in_flight
    model = ModelConfig(num_layers=8, hidden_size=256, num_attention_heads=4, seq_length=128,
                        vocab_size=4096)
    topo = Topology(num_nodes=1, gpus_per_node=4, gpu_memory_gb=0.5)
    setup = Setup(model, "fp32")
    times = LayerTimes(setup, AnalyticProfile(device_tflops=1.0), topo)
    layout = Layout("gpipe", 1, 4, 1, 4, 24)
    full = stage_plan(setup, layout, times, topo)
    usable = topo.usable_memory_gb * 2 ** 30
    assert full.max_memory > usable
    split = _fewer_in_flight(setup, layout, times, topo, full, usable)
    k = split.layout.microbatches_per_flush
    assert 1 < k < 24 and split.max_memory <= usable
    exact = stage_plan(setup, split.layout, times, topo)
    more = stage_plan(setup, Layout("gpipe", 1, 4, 1, 4, 24, microbatches_per_flush=k + 1),
                      times, topo)
    assert more.max_memory > usable  # k is the largest that fits
    assert split.peak_in_flight == exact.peak_in_flight == [k] * 4
    for a, b in zip(split.memory, exact.memory):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-12, abs=1e-3)
    assert predict(split).time_per_batch == predict(exact).time_per_batch


def test_auto_plan_and_tools_plan_set_the_flushes_and_say_why(tmp_path):
    """--auto-plan --pipeline-schedule gpipe where all m stashes do not fit: the config gets the
    flush size, the plan line the flag and the reason; a given size is kept; tools/plan.py
    prints the flag, the reason and the JSON field."""
    import io
    import json
    from megatron_2bw.planner.cli import run as plan_run
    from test_planner_grad_buffers import _auto_plan
    shape = ("--mock-data --num-layers 4 --hidden-size 64 --num-attention-heads 4 "
             "--seq-length 32 --vocab-size 512 --global-batch-size 32 "
             "--pipeline-schedule gpipe --pipeline-model-parallel-size 2").split()
    cfg, lines = _auto_plan(shape, 2, tmp_path, 0.006)
    k = cfg.microbatches_per_flush
    assert k and k < cfg.num_microbatches, lines
    assert f"--gpipe-microbatches-per-flush {k}" in lines[0] and "in flight do not fit" in lines[0]
    roomy, lines = _auto_plan(shape, 2, tmp_path, 1.0)
    assert roomy.microbatches_per_flush is None and "flushes" not in lines[0]
    given, _ = _auto_plan(shape + ["--gpipe-microbatches-per-flush", "1"], 2, tmp_path, 0.006)
    assert given.microbatches_per_flush == 1
    argv = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
            "--vocab-size 512 --num-gpus 2 --gpus-per-node 2 --global-batch-size 32 "
            "--schedules gpipe --gpu-memory-gb 0.006").split()
    out = io.StringIO()
    assert plan_run(argv, out) == 0
    text = out.getvalue()
    assert "--gpipe-microbatches-per-flush" in text and "in flight do not fit" in text
    out = io.StringIO()
    assert plan_run(argv + ["--json"], out) == 0
    data = json.loads(out.getvalue())
    assert data["chosen"]["microbatches_per_flush"] and data["gpipe_flushes"]
