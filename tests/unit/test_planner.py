"""Planner parts without processes: topology, profiles, partitioner, cost model, simulator glue."""
import io
import itertools
import json

import pytest

from megatron_2bw.config import ModelConfig
from megatron_2bw.models.flops import layer_costs
from megatron_2bw.models.partition import partition
from megatron_2bw.models.partition import PartitionError, bottleneck, stage_sums
from megatron_2bw.planner import (AnalyticProfile, PlanError, Topology, load_profile, predict,
                                  resolve_topology, save_profile)
from megatron_2bw.planner.cli import run as plan_run
from megatron_2bw.planner.cost_model import LayerTimes, Layout, Setup, stage_plan
from megatron_2bw.planner.profile import MeasuredProfile, profile_from_dict
from megatron_2bw.planner.simulate import run_segment
from megatron_2bw.schedule.simulate import simulate
from megatron_2bw.schedule.tables import count_in_flight, make_schedule

MODEL = ModelConfig(num_layers=6, hidden_size=64, num_attention_heads=4, seq_length=32,
                    vocab_size=512)


# ---- topology ----------------------------------------------------------------------------------


def test_topology_sources_and_precedence(tmp_path):
    env = {"SLURM_JOB_NUM_NODES": "4", "SLURM_GPUS_ON_NODE": "4"}
    t = resolve_topology(env=env)
    assert (t.num_nodes, t.gpus_per_node, t.num_gpus) == (4, 4, 16)
    env = {"SLURM_NNODES": "2", "SLURM_GPUS_PER_NODE": "gpu:8"}
    assert resolve_topology(env=env).num_gpus == 16
    path = tmp_path / "topo.json"
    Topology(num_nodes=2, gpus_per_node=2, gpu_memory_gb=16).to_json(str(path))
    t = resolve_topology({"gpu_memory_gb": 40.0}, str(path), env=env)  # flags > file > env
    assert (t.num_nodes, t.gpus_per_node, t.gpu_memory_gb) == (2, 2, 40.0)
    t = resolve_topology({"gpus_per_node": 4}, env={}, num_gpus=12)
    assert (t.num_nodes, t.gpus_per_node) == (3, 4)
    assert resolve_topology(env={}, num_gpus=2).num_gpus == 2  # one small node


@pytest.mark.parametrize("flags,num_gpus,match", [
    ({"gpu_memory_gb": 0}, None, "--gpu-memory-gb must be > 0, got 0"),
    ({"gpus_per_node": 8}, 12, "--num-gpus 12 is not divisible by --gpus-per-node 8"),
    ({"num_nodes": 0}, None, "--num-nodes must be an integer >= 1"),
    ({"inter_node_bandwidth_gbps": -1}, None, "--inter-node-bandwidth-gbps must be > 0"),
    ({"num_nodes": 3, "gpus_per_node": 8}, 16, "give two of the three"),
    ({"bogus": 1}, None, "unknown topology field 'bogus'"),
])
def test_topology_bad_inputs(flags, num_gpus, match):
    with pytest.raises(PlanError, match=match) as e:
        resolve_topology(flags, env={}, num_gpus=num_gpus)
    assert "\n" not in str(e.value)


def test_topology_file_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(PlanError, match="not valid JSON"):
        resolve_topology(path=str(bad), env={})
    bad.write_text(json.dumps({"gpus": 3}))
    with pytest.raises(PlanError, match="unknown key 'gpus'"):
        resolve_topology(path=str(bad), env={})
    with pytest.raises(PlanError, match="missing.json: no such file; give a topology JSON"):
        resolve_topology(path=str(tmp_path / "missing.json"), env={})


def test_links_and_ring_allreduce():
    t = Topology(num_nodes=2, gpus_per_node=4, intra_node_bandwidth_gbps=800,
                 inter_node_bandwidth_gbps=80, intra_node_latency_us=0, inter_node_latency_us=0)
    assert t.transfer_time(1e8, False) == pytest.approx(1e8 / 100e9)
    assert t.transfer_time(1e8, True) == pytest.approx(1e8 / 10e9)
    assert t.allreduce_time(1e8, [0, 1, 2, 3]) == pytest.approx(2 * 3 / 4 * 1e8 / 100e9)
    assert t.allreduce_time(1e8, [0, 4]) == pytest.approx(1e8 / 10e9)  # crosses nodes
    assert t.allreduce_time(1e8, [5]) == 0.0


# ---- profiles ----------------------------------------------------------------------------------


def test_analytic_profile_times_from_flops():
    p = AnalyticProfile(device_tflops=100, efficiency=0.5, memory_bandwidth_gb_per_s=1e9)
    cost = layer_costs(MODEL, 4)[1]
    fwd, bwd = p.layer_times(cost, 4)
    assert fwd == pytest.approx(cost.fwd_flops / 50e12)
    assert bwd == pytest.approx(2 * fwd)
    with pytest.raises(PlanError, match="--device-efficiency must be in"):
        AnalyticProfile(efficiency=0).validate()


def test_measured_profile_json_round_trip_and_interpolation(tmp_path):
    layers = {k: {1: (1.0, 2.0), 4: (4.0, 8.0)} for k in ("embedding", "transformer", "head")}
    shape = {"hidden_size": 64, "seq_length": 32}
    prof = MeasuredProfile(shape, layers, 1e-9, "fp32", "cpu", data_s_per_sample=0.5).validate()
    path = tmp_path / "p.json"
    save_profile(prof, str(path))
    loaded = load_profile(str(path))
    assert loaded.layers == layers and loaded.model == shape
    assert loaded.data_time(4) == pytest.approx(2.0)
    old = prof.to_dict()
    del old["data_s_per_sample"]  # profiles written before the field existed: no data time
    assert profile_from_dict(old).data_time(4) == 0.0
    with pytest.raises(PlanError, match="data_s_per_sample must be a finite number >= 0"):
        profile_from_dict(dict(old, data_s_per_sample=-1))
    cost = layer_costs(MODEL, 2)[1]
    assert loaded.layer_times(cost, 2) == pytest.approx((2.0, 4.0))      # interpolated
    assert loaded.layer_times(cost, 8) == pytest.approx((8.0, 16.0))     # scaled
    assert loaded.layer_times(cost, 4, tensor=2) == pytest.approx((2.0, 4.0))
    assert loaded.step_time(10 ** 9) == pytest.approx(1.0)
    loaded.check_model(MODEL, "fp32")
    with pytest.raises(PlanError, match="was measured for hidden_size 64, not 128"):
        loaded.check_model(ModelConfig(hidden_size=128, num_attention_heads=4), "fp32")
    with pytest.raises(PlanError, match="was measured in fp32, not bf16"):
        loaded.check_model(MODEL, "bf16")
    with pytest.raises(PlanError, match="no timings for layer type 'transformer'"):
        profile_from_dict({"source": "measured", "step_s_per_param": 0,
                           "layers": {"embedding": {"1": {"forward_s": 1, "backward_s": 1}}}})
    with pytest.raises(PlanError, match="source"):
        profile_from_dict({"kind": "x"})


def test_measure_profile_on_this_cpu():
    from megatron_2bw.planner import measure_profile
    tiny = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=8,
                       vocab_size=64)
    prof = measure_profile(tiny, (1, 2), repeats=2)  # medians of 3: a preempted read is no median
    assert set(prof.layers) == {"embedding", "transformer", "head"}
    assert all(f > 0 and b > 0 for t in prof.layers.values() for f, b in t.values())
    assert prof.step_s_per_param > 0
    assert 0 < prof.data_s_per_sample < 0.01  # reading a few tokens: microseconds, not seconds
    profile_from_dict(prof.to_dict()).check_model(tiny, "fp32")


# ---- partitioner -------------------------------------------------------------------------------


def _brute(costs, d):
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), d - 1):
        b = [0, *cuts, n]
        worst = max(sum(costs[b[i]:b[i + 1]]) for i in range(d))
        best = worst if best is None else min(best, worst)
    return best


def test_partition_equals_brute_force():
    import random
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 9)
        d = rng.randint(1, n)
        costs = [rng.choice([0.0, 1.0, rng.uniform(0, 5), rng.randint(1, 4)]) for _ in range(n)]
        bounds = partition(costs, d)
        assert bounds[0] == 0 and bounds[-1] == n and len(bounds) == d + 1
        assert all(a < b for a, b in zip(bounds, bounds[1:])), "every stage non-empty"
        assert max(stage_sums(costs, bounds)) == pytest.approx(_brute(costs, d))
        assert bottleneck(costs, d) == pytest.approx(_brute(costs, d))


def test_partition_weighs_embedding_and_head():
    # expensive head: the last stage takes fewer blocks than a uniform split would give it
    costs = [0.5] + [1.0] * 8 + [3.0]
    bounds = partition(costs, 4)
    assert max(stage_sums(costs, bounds)) == 3.0
    assert bounds[-2] >= 8  # head alone (or with nothing heavier than itself)
    with pytest.raises(PartitionError, match="cannot split 3 layers into 4"):
        partition([1, 1, 1], 4)


# ---- cost model and simulator glue -------------------------------------------------------------


def _plan(schedule="2bw", d=2, m=4, w=1, b=2, topo=None, recompute=False, **kw):
    topo = topo or Topology(num_nodes=1, gpus_per_node=8)
    setup = Setup(MODEL, "fp32", "adam")
    layout = Layout(schedule, 1, d, w, b, m, recompute, **kw)
    return stage_plan(setup, layout, LayerTimes(setup, AnalyticProfile(), topo), topo)


@pytest.mark.parametrize("schedule", ["2bw", "flush", "gpipe"])
def test_peak_in_flight_equals_schedule_and_simulator(schedule):
    """The cost model's stash count is the schedule kind's, which the tables bear out."""
    for d, m in ((2, 2), (3, 5), (4, 8)):
        plan = _plan(schedule, d, m)
        res = run_segment(plan, 3)
        table = make_schedule(schedule, d, m, 3).table()
        assert plan.peak_in_flight == res.peak_in_flight == \
            [count_in_flight(acts) for acts in table]


def test_reading_a_microbatch_costs_the_first_and_last_stage_forward():
    topo = Topology(num_nodes=1, gpus_per_node=8)
    setup = Setup(MODEL, "fp32", "adam")
    table = {k: {1: (1.0, 2.0)} for k in ("embedding", "transformer", "head")}
    plans = [stage_plan(setup, Layout("flush", 1, 3, 1, 2, 4),
                        LayerTimes(setup, MeasuredProfile({}, table, 0.0, data_s_per_sample=x),
                                   topo), topo) for x in (0.0, 0.25)]
    assert [b - a for a, b in zip(plans[0].fwd, plans[1].fwd)] == pytest.approx([0.5, 0, 0.5])
    assert plans[0].bwd == plans[1].bwd


def test_partition_minimizes_the_slowest_stage_with_the_data_read_included():
    topo = Topology(num_nodes=1, gpus_per_node=8)
    setup = Setup(MODEL, "fp32", "adam")
    table = {"embedding": {1: (0.1, 0.1)}, "transformer": {1: (1.0, 2.0)}, "head": {1: (0.5, 0.5)}}
    for data in (0.0, 1.0, 2.5, 4.0):
        prof = MeasuredProfile({}, table, 0.0, data_s_per_sample=data)
        for d in (2, 3, 4):
            times = LayerTimes(setup, prof, topo)
            n = len(times.get(1, 1)[0])

            def slowest(bounds):
                plan = stage_plan(setup, Layout("flush", 1, d, 1, 1, 4), times, topo, bounds)
                return max(f + b for f, b in zip(plan.fwd, plan.bwd))
            cuts = itertools.combinations(range(1, n), d - 1)
            best = min(slowest([0, *c, n]) for c in cuts)
            assert slowest(times.partition(1, 1, d, False)) == pytest.approx(best), (data, d)


def test_2bw_reduction_overlaps_exactly_one_forward():
    for d in (2, 3, 4):
        acts = make_schedule("2bw", d, d + 1, 3).window(0, 1)
        for s in range(d):
            acts = make_schedule("2bw", d, d + 1, 3).window(s, 1)
            i = next(k for k, a in enumerate(acts) if a.kind == "R")
            j = next(k for k, a in enumerate(acts) if a.kind == "N")
            assert [a.kind for a in acts[i + 1:j] if a.is_compute] == ["F"]


def test_prediction_is_the_simulators_time():
    for schedule in ("2bw", "flush", "gpipe"):
        plan = _plan(schedule, 2, 4)
        est = predict(plan)
        dur, comm = plan.durations()
        runs = [simulate(make_schedule(schedule, 2, 4, T), dur, comm).makespan for T in (3, 4)]
        assert est.source == "simulated"
        assert est.time_per_batch == pytest.approx(runs[1] - runs[0], rel=1e-12)
        assert est.time_per_batch >= est.lower_bound


def test_extrapolation_matches_full_simulation():
    for schedule in ("2bw", "flush", "gpipe"):
        plan = _plan(schedule, 2, 40, b=1)
        est, full = predict(plan), predict(plan, full=True)
        assert est.source in ("extrapolated", "bound") and full.source in ("simulated", "bound")
        assert est.time_per_batch == pytest.approx(full.time_per_batch, rel=0.02)


def test_memory_model_components():
    plan = _plan("2bw", 2, 4)
    flush = _plan("flush", 2, 4)
    gpipe = _plan("gpipe", 2, 4)
    m2, mf, mg = plan.memory[0], flush.memory[0], gpipe.memory[0]
    assert m2["weights"] == 2 * mf["weights"] and m2["grads"] == 2 * mf["grads"]
    assert m2["optimizer"] == mf["optimizer"] == 2 * mf["weights"]  # Adam: two fp32 copies
    assert m2["activations"] == mf["activations"] < mg["activations"]  # 2 vs 4 in flight
    rc = _plan("gpipe", 2, 4, recompute=True)
    assert rc.memory[0]["activations"] < mg["activations"]
    assert gpipe.fwd[0] > rc.bwd[0] - gpipe.bwd[0] > 0  # the blocks, not the embedding, rerun


def test_measure_profile_bert():
    from megatron_2bw.planner import measure_profile
    tiny = ModelConfig(family="bert", num_layers=1, hidden_size=32, num_attention_heads=2,
                       seq_length=8, vocab_size=64)
    prof = measure_profile(tiny, (1,), repeats=1)
    assert all(f > 0 and b > 0 for t in prof.layers.values() for f, b in t.values())
    with pytest.raises(PlanError, match="was measured for family bert, not gpt"):
        prof.check_model(ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2,
                                     seq_length=8, vocab_size=64), "fp32")


def test_cli_table_names_the_shared_nics():
    argv = ("--model gpt-1.3b --num-nodes 2 --gpus-per-node 8 --global-batch-size 128 --bf16 "
            "--nics-per-node 1 --nic-bandwidth-gbps 25 --top 1")
    out = io.StringIO()
    assert plan_run(argv.split(), out) == 0
    assert "(80 GB, 2400/200 Gbit/s, 1 x 25 Gbit/s NIC per node)" in out.getvalue()
