"""Issue 30: the planner on the paper's case (PipeDream-2BW, ICML 2021: 8 x 8 V100-16GB, one
shared 25 Gbit/s NIC per server): sequence-parallel pricing, the microbatch-size efficiency
curve, GPipe's memory, shared NICs, the search's work."""
from dataclasses import replace

import pytest

from megatron_2bw.models.flops import DTYPE_BYTES, layer_costs, named_model
from megatron_2bw.planner import AnalyticProfile, MeasuredProfile, PlanError, Topology
from megatron_2bw.planner.auto import flushes_reason
from megatron_2bw.planner.cost_model import LayerTimes, Layout, Setup, stage_plan
from megatron_2bw.planner.search import search
from megatron_2bw.planner.simulate import predict
from megatron_2bw.planner.topology import GB
from megatron_2bw.planner.curve import DEVICES, gemm_efficiency, ridge_tokens


@pytest.mark.parametrize("sp", [False, True])
def test_sequence_parallel_collectives_are_priced_at_the_full_activation(sp):
    """All-gather + reduce-scatter move what the all-reduce moved: the whole b*s*h activation,
    not the 1/t chunk a sequence-parallel stage boundary sends (the bug priced it at 1/t)."""
    model = named_model("gpt-3.8b")
    topo = Topology(num_nodes=8, gpus_per_node=8, gpu_memory_gb=16)
    prof = AnalyticProfile()
    times = LayerTimes(Setup(model, "fp16"), prof, topo)
    b, t = 64, 8
    costs, fwd, bwd = times.get(b, t, sp)
    layer = costs[1]
    full = DTYPE_BYTES["fp16"] * b * model.seq_length * model.hidden_size
    assert layer.output_bytes == pytest.approx(full / (t if sp else 1))  # the boundary message
    one = topo.ring_time(full, t, False)
    compute_f, compute_b = prof.layer_times(layer, b, t)
    print(f"sp={sp}: tensor-parallel comm per layer and pass {2 * one * 1e3:.3f} ms")
    assert fwd[1] - compute_f == pytest.approx(2 * one)
    assert bwd[1] - compute_b == pytest.approx(2 * one)


def _per_sample(prof, model, b):
    costs = LayerTimes(Setup(model, "fp16"), prof, Topology()).get(b, 1)[0]
    f, g = prof.layer_times(costs[1], b, 1, tokens=b * model.seq_length)
    return (f + g) / b


def _paper_gpt(name):
    """The paper's GPT experiments run at sequence length 512 (Sec. 5.2)."""
    return replace(named_model(name), seq_length=512, max_position_embeddings=None)


@pytest.mark.parametrize("device", sorted(DEVICES))
def test_gemm_efficiency_curve_is_monotone_in_the_microbatch(device):
    model = _paper_gpt("gpt-2.2b")
    prof = AnalyticProfile.for_device(device)
    per = [_per_sample(prof, model, b) for b in (1, 2, 4, 8, 16, 32, 64)]
    print(device, "throughput b=16 / b=1:", round(per[0] / per[4], 2))
    assert all(x > y for x, y in zip(per, per[1:])), per  # time per sample falls with b
    plateau = 3 * layer_costs(model, 1, 1, "fp16")[1].fwd_flops / (
        prof.device_tflops * 1e12 * prof.efficiency)
    assert all(x > plateau for x in per)  # never faster than the plateau
    if device == "v100":  # the paper's Fig. 12: about 4x from b=1 to b=16 (at its seq 512)
        assert per[0] / per[4] == pytest.approx(4.0, rel=0.01)
    assert gemm_efficiency(10 ** 9, prof.gemm_half_tokens) > 0.99


def test_measured_profile_fits_its_own_curve():
    """A measured profile whose times are t(b) = alpha + beta*b: the fit recovers them, the
    analytic profile built from it reproduces the measured points, and b beyond the measured
    range follows the curve (not proportional scaling)."""
    model = named_model("debug")
    alpha, beta = 3e-3, 1e-3
    times = {b: (alpha / 3 + beta / 3 * b, 2 * alpha / 3 + 2 * beta / 3 * b) for b in (1, 2, 4)}
    layers = {k: dict(times) for k in ("embedding", "transformer", "head")}
    measured = MeasuredProfile({}, layers, 0.0).validate()
    assert measured.curve() == pytest.approx((alpha, beta))
    fitted = AnalyticProfile.from_measured(measured, model)
    assert fitted.gemm_half_tokens == pytest.approx(alpha / beta * model.seq_length)
    layer = layer_costs(model, 1)[1]
    for b in (1, 2, 4, 8):
        f, g = fitted.layer_times(layer_costs(model, b)[1], b, tokens=b * model.seq_length)
        assert f + g == pytest.approx(alpha + beta * b, rel=1e-6), b
    assert sum(measured.layer_times(layer, 8)) == pytest.approx(alpha + beta * 8)
    assert sum(measured.layer_times(layer, 8)) < 2 * sum(times[4])  # not 8/4 x t(4)
    with pytest.raises(PlanError, match="unknown device 'tpu'"):
        AnalyticProfile.for_device("tpu")


@pytest.mark.parametrize("device", sorted(DEVICES))
def test_tensor_ranks_share_only_the_weights_part_of_the_fixed_cost(device):
    """t ranks share a layer's FLOPs and its weights' memory traffic (the curve's M_half up to the
    roofline's ridge), not the rest of its fixed cost (kernel launches, framework work), which
    every rank pays in full: the V100 curve's M_half (4 x 512 rows) is mostly that, the A100,
    H100 and H200 curves' M_half is the ridge itself, so t divides their times exactly.
    (Sequence parallelism: no norm or residual add repeated on every rank, the next test.)"""
    model = _paper_gpt("gpt-2.2b")
    prof = AnalyticProfile.for_device(device)
    half = prof.gemm_half_tokens
    ridge = ridge_tokens(prof.device_tflops, prof.memory_bandwidth_gb_per_s)
    plateau = prof.device_tflops * 1e12 * prof.efficiency
    for b in (1, 8, 64):
        rows = b * model.seq_length
        one, eight = (layer_costs(model, b, t, "fp16", sequence_parallel=True)[1]
                      for t in (1, 8))
        f1 = prof.layer_times(one, b, 1, tokens=rows)[0]
        f8 = prof.layer_times(eight, b, 8, tokens=rows)[0]
        assert f1 == pytest.approx(one.fwd_flops / plateau * (1 + half / rows))
        weights = min(half, ridge)
        assert f8 == pytest.approx(eight.fwd_flops / plateau
                                   * (1 + (weights + 8 * (half - weights)) / rows))
        if half <= ridge:
            assert f8 == pytest.approx(f1 * eight.fwd_flops / one.fwd_flops)
        else:  # V100: slower than 1/8 of the layer, and more so the smaller the microbatch
            assert f8 > 1.01 * f1 * eight.fwd_flops / one.fwd_flops
    # without a curve (one efficiency for every b) and for measured profiles: 1/t of the time
    flat = AnalyticProfile()
    costs = [layer_costs(model, 8, t, "fp16", sequence_parallel=True)[1] for t in (1, 8)]
    assert flat.layer_times(costs[1], 8, 8, tokens=4096)[0] == pytest.approx(
        flat.layer_times(costs[0], 8, 1, tokens=4096)[0] * costs[1].fwd_flops / costs[0].fwd_flops)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_without_sequence_parallelism_every_tensor_rank_repeats_the_norms_and_residual_adds(
        dropout):
    """Megatron's tensor parallelism without sequence parallelism runs each transformer layer's
    two norms and two residual adds (bias, dropout) on the whole b*s*h activation on every rank:
    their memory traffic (a norm reads and writes it, an add reads two and writes one, dropout
    writes a mask byte) is charged in full beyond the rank's 1/t share, twice in the backward;
    nothing at t = 1 or with sequence parallelism, which splits them."""
    model = replace(_paper_gpt("gpt-2.2b"), hidden_dropout=dropout)
    prof = AnalyticProfile.for_device("v100")
    bw = prof.memory_bandwidth_gb_per_s * 1e9 * prof.efficiency
    b, s, h = 8, model.seq_length, model.hidden_size
    assert layer_costs(model, b, 1, "fp16")[1].replicated_bytes == 0.0
    for t in (2, 8):
        plain, split = (layer_costs(model, b, t, "fp16", sequence_parallel=sp)[1]
                        for sp in (False, True))
        assert split.replicated_bytes == 0.0
        assert plain.replicated_bytes == b * s * h * (2 * 2 * 2 + 2 * (3 * 2 + (dropout > 0)))
        (f, g), (f_sp, g_sp) = (prof.layer_times(c, b, t, tokens=b * s) for c in (plain, split))
        extra = plain.replicated_bytes * (1 - 1 / t) / bw
        assert f - f_sp == pytest.approx(extra) and g - g_sp == pytest.approx(2 * extra)


V100_CLUSTER = dict(num_nodes=8, gpus_per_node=8, gpu_memory_gb=16, inter_node_bandwidth_gbps=25)
PAPER_SPACE = dict(tensor_sizes=(1,), distributed_optimizer=(False,), sequence_parallel=(False,),
                   dtype="fp16")


def test_gpipe_on_the_papers_case_is_out_of_memory():
    """GPT-2.2B (seq 512) on one server of 8 V100-16GB at B=64, the paper's memory case: GPipe
    stashes all m forwards' activations (no recomputation), each with its loss state (one fp32
    copy of the logits on the last stage): it does not fit, as in the paper, while flush and
    2BW (1F1B: the last stage holds one) do."""
    model, topo = _paper_gpt("gpt-2.2b"), Topology(**dict(V100_CLUSTER, num_nodes=1))
    prof = AnalyticProfile.for_device("v100")
    kw = dict(PAPER_SPACE, recompute=(False, "selective"))
    with pytest.raises(PlanError, match="does not fit: smallest footprint") as e:
        search(model, topo, prof, 64, schedules=("gpipe",), gpipe_flushes=False, **kw)
    print(e.value)
    # as the paper's GPipe runs such a batch: in flushes of the few microbatches it can admit
    # (Sec. 5.3), each a pipeline fill of its own; the plan line says why
    split = search(model, topo, prof, 64, schedules=("gpipe",), **kw).best
    k, m = split.layout.microbatches_per_flush, split.layout.num_microbatches
    print(split.layout.describe(), f"{max(split.memory_gb):.2f} GB")
    assert k and k < m and max(split.memory_gb) <= topo.usable_memory_gb
    assert f"gpipe in flushes of {k} microbatch" in flushes_reason(split, topo)
    assert split.plan.all_in_flight_memory / GB > topo.usable_memory_gb
    one_flush = stage_plan(Setup(model, "fp16"), replace(split.layout, microbatches_per_flush=None),
                           LayerTimes(Setup(model, "fp16"), prof, topo), topo)
    assert predict(one_flush).time_per_batch < split.time_per_batch  # what the flushes cost
    for schedule in ("flush", "2bw"):
        best = search(model, topo, prof, 64, schedules=(schedule,), **kw).best
        print(schedule, best.layout.describe(), f"{max(best.memory_gb):.2f} GB")
        assert max(best.memory_gb) <= topo.usable_memory_gb
    # per in-flight microbatch the last stage keeps what the loss saved (the head's activations:
    # one fp32 copy of the logits); the fp32 logits beside it exist for one microbatch at a time
    setup = Setup(model, "fp16")
    times = LayerTimes(setup, prof, topo)
    gp = stage_plan(setup, Layout("gpipe", 1, 8, 1, 1, 8), times, topo)
    fl = stage_plan(setup, Layout("flush", 1, 8, 1, 1, 8), times, topo)
    logits = 4.0 * model.seq_length * model.vocab_size
    head = layer_costs(model, 1, 1, "fp16")[-1]
    assert head.act_bytes > logits  # the loss's saved fp32 copy is part of the head's
    assert (gp.peak_in_flight[-1], fl.peak_in_flight[-1]) == (8, 1)
    assert gp.memory[-1]["activations"] == pytest.approx(
        8 * fl.memory[-1]["activations"] + logits, rel=1e-9)


def test_the_gradient_all_reduce_moves_setups_bytes_per_element():
    """The engine reduces fp32 buffers; the paper's Megatron-LM (2020) reduced fp16 gradients
    (bench/paper_table.py): the ring carries half the bytes."""
    model, topo = named_model("gpt-2.2b"), Topology(**V100_CLUSTER)
    prof = AnalyticProfile.for_device("v100")
    layout = Layout("2bw", 1, 8, 8, 1, 8, rank_order="tp-pp-dp")  # rings across the servers
    plans = []
    for nbytes in (4.0, 2.0):
        setup = Setup(model, "fp16", grad_reduce_bytes=nbytes)
        plans.append(stage_plan(setup, layout, LayerTimes(setup, prof, topo), topo))
    params = plans[0].memory[3]["optimizer"] / 8  # Adam's two fp32 copies of a middle stage
    assert plans[0].allreduce[3] == pytest.approx(topo.ring_time(4.0 * params, 8, True), rel=1e-3)
    assert plans[1].allreduce[3] == pytest.approx(topo.ring_time(2.0 * params, 8, True), rel=1e-3)


PAPER_NICS = dict(V100_CLUSTER, nics_per_node=1, nic_bandwidth_gbps=25)


def test_concurrent_flows_share_a_nodes_nics():
    shared, alone = Topology(**PAPER_NICS), Topology(**V100_CLUSTER)
    assert shared.link(True)[0] == alone.link(True)[0] == 25e9 / 8
    assert shared.link(True, flows=8)[0] == pytest.approx(25e9 / 8 / 8)  # 3.125 Gbit/s each
    assert alone.link(True, flows=8) == alone.link(True)  # no NICs given: the old meaning
    assert shared.link(False, flows=8) == alone.link(False)  # NVLink is not shared
    assert shared.ring_time(1e9, 8, True, 4) == pytest.approx(4 * alone.ring_time(1e9, 8, True),
                                                              rel=1e-3)
    for bad, match in (({"nics_per_node": -1}, "--nics-per-node must be an integer >= 0"),
                       ({"nics_per_node": 1}, "--nic-bandwidth-gbps must be > 0"),
                       ({"nic_bandwidth_gbps": 10},
                        "--nic-bandwidth-gbps 10 needs --nics-per-node"),
                       ({"memory_reserve_fraction": 1.5}, "--memory-reserve-fraction must be")):
        with pytest.raises(PlanError, match=match):
            Topology(**bad).validate()


@pytest.mark.parametrize("layout,p2p_flows,dp_flows", [
    (Layout("2bw", 1, 8, 8, 1, 8, rank_order="tp-dp-pp"), 8, 1),   # a node = one stage's replicas
    (Layout("2bw", 1, 8, 8, 1, 8, rank_order="tp-pp-dp"), 1, 8),   # a node = one whole pipeline
    (Layout("2bw", 8, 8, 1, 1, 8), 8, 1),                          # every tensor rank sends
])
def test_the_cost_model_prices_shared_nics_by_the_layouts_concurrent_flows(layout, p2p_flows,
                                                                           dp_flows):
    model = named_model("gpt-2.2b")
    setup, prof = Setup(model, "fp16"), AnalyticProfile.for_device("v100")
    shared, alone = Topology(**PAPER_NICS), Topology(**V100_CLUSTER)
    a = stage_plan(setup, layout, LayerTimes(setup, prof, alone), alone)
    b = stage_plan(setup, layout, LayerTimes(setup, prof, shared), shared)
    assert LayerTimes(setup, prof, shared).placement(layout)[4] == (p2p_flows, dp_flows)
    for s, inter in enumerate(b.inter_node_p2p):
        message = 2.0 * model.seq_length * model.hidden_size  # fp16, b=1
        assert b.p2p[s] == pytest.approx(shared.transfer_time(message, inter, p2p_flows))
        assert b.p2p[s] >= a.p2p[s]
    assert b.allreduce[3] >= a.allreduce[3]  # a middle stage: no tied embedding
    if dp_flows > 1:
        assert b.allreduce[3] > a.allreduce[3] * (dp_flows - 0.5)


PLAN_64 = ("--model gpt-3.8b --num-nodes 8 --gpus-per-node 8 --gpu-memory-gb 16 "
           "--inter-node-bandwidth-gbps 25 --global-batch-size 512 --fp16 --top 1 --json")
PLAN_4096 = ("--model gpt-13b --num-nodes 512 --gpus-per-node 8 --gpu-memory-gb 80 "
             "--global-batch-size 4096 --bf16 --top 1 --json")


@pytest.mark.parametrize("argv", [PLAN_64, PLAN_4096], ids=["64", "4096"])
def test_plan_is_one_search_with_few_simulations(argv, monkeypatch):
    """tools/plan.py's distributed-optimizer explanation comes out of the same search (one
    call), and branch and bound simulates a handful of the thousands of layouts that fit; the
    CPU time is printed, not asserted."""
    import io
    import json
    import time

    from megatron_2bw.planner import cli
    calls = []

    def counting(*a, **kw):
        calls.append(kw.get("group") is not None)
        return search(*a, **kw)
    monkeypatch.setattr(cli, "search", counting)
    t0, out = time.process_time(), io.StringIO()
    assert cli.run(argv.split(), out) == 0
    cpu = time.process_time() - t0
    data = json.loads(out.getvalue())
    print(f"{argv.split()[3]} nodes: {cpu:.2f} s CPU, {data['considered']} layouts, "
          f"{data['examined']} planned, {data['fitting']} fit, {data['simulated']} simulated")
    assert calls == [True]  # one search, grouped by the distributed optimizer
    assert data["fitting"] > 1000 and data["simulated"] <= 40
    assert data["distributed_optimizer"].startswith("distributed optimizer: ")


def test_the_p2p_floor_prunes_a_slow_link():
    """At 3.125 Gbit/s per GPU (the paper's NIC shared 8 ways) the lower bound counts each
    microbatch's blocking receives: the search simulates far fewer layouts than fit, and its
    choice equals the exhaustive one."""
    model, topo = named_model("gpt-2.2b"), Topology(**dict(V100_CLUSTER,
                                                           inter_node_bandwidth_gbps=3.125))
    kw = dict(dtype="fp16", tensor_sizes=(1,), distributed_optimizer=(False,),
              sequence_parallel=(False,), schedules=("2bw", "flush"), pipeline_sizes=(4, 8, 16),
              micro_batches=(1, 2, 4))
    fast = search(model, topo, AnalyticProfile(), 512, top_k=1, **kw)
    print(f"{fast.fitting} fit, {fast.simulated} simulated")
    assert fast.simulated < fast.fitting / 2  # without the p2p floor: 37 of 56
    every = search(model, topo, AnalyticProfile(), 512, exhaustive=True, **kw)
    assert every.best.layout == fast.best.layout


def test_placement_rank_arithmetic_is_the_grids():
    from megatron_2bw.parallel.grid import ProcessGrid
    from megatron_2bw.planner.placement import rank_of
    for order in ("tp-dp-pp", "tp-pp-dp"):
        grid = ProcessGrid(2, 3, 4, rank_order=order)
        assert all(rank_of(i, s, j, 2, 3, 4, order) == grid.rank_of(i, s, j)
                   for i in range(2) for s in range(3) for j in range(4))


def test_a_comm_group_holds_at_most_one_receive_of_each_kind():
    """What `StagePlan.comm_floor` relies on, for every generated table."""
    from megatron_2bw.schedule.tables import make_schedule
    groups = 0
    for name in ("2bw", "flush", "gpipe"):
        for d in (2, 3, 4, 8):
            for m in (d, d + 1, 2 * d):
                sched = make_schedule(name, d, m, 4)
                for s in range(d):
                    run = []
                    for a in sched.actions(s) + [None]:
                        if a is not None and a.is_comm:
                            run.append(a.kind)
                        elif run:
                            groups += 1
                            assert run.count("ra") <= 1 and run.count("rg") <= 1, (name, d, m, s)
                            run = []
    assert groups > 1000


@pytest.mark.parametrize("model,depth", [("gpt-2.2b", 8), ("gpt-3.8b", 16)])
def test_the_paper_space_picks_hold_with_the_existing_flags(model, depth):
    """The paper's space (t=1, no distributed optimizer, no sequence parallelism, stages
    balanced in time as its planner cuts them: --partition balanced) on 8 x 8 16-GB GPUs at 25
    Gbit/s per GPU, fp16, B=512, with the flags as they were (no --device, no NICs): d=8 for
    GPT-2.2B, d=16 for GPT-3.8B, as in the paper. (With partitions that fit, GPT-3.8B runs
    faster at d=8 with fewer layers on its fullest stages: test_partition_fits.py.)"""
    import io
    import json

    from megatron_2bw.planner.cli import run
    out = io.StringIO()
    argv = (f"--model {model} --num-nodes 8 --gpus-per-node 8 --gpu-memory-gb 16 "
            "--inter-node-bandwidth-gbps 25 --global-batch-size 512 --fp16 --tensor-sizes 1 "
            "--distributed-optimizer off --sequence-parallel off --schedules 2bw --top 1 --json "
            "--partition balanced")
    assert run(argv.split(), out) == 0
    chosen = json.loads(out.getvalue())["chosen"]
    assert (chosen["pipeline"], chosen["tensor"], chosen["distributed_optimizer"]) == \
        (depth, 1, False)


def _paper_table():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "bench" / "paper_table.py"
    spec = importlib.util.spec_from_file_location("paper_table", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_papers_memory_observations_leave_a_usable_interval():
    """bench/paper_memory.py: in this accounting (the paper's attention without FlashAttention)
    everything the paper saw fit needs less than everything it saw run out of memory, so a usable
    memory agrees with all of them; the table runs at the middle. Each pair is monotone (the
    larger microbatch or batch needs more), and the s x s attention scores are what make the
    paper's no-recomputation limits (Fig. 12) agree with its GPipe limit (Sec. 5.3)."""
    P = _paper_table()
    import paper_memory as M
    seen = M.observed_memory()
    for what, fit, gib in seen:
        print(f"{gib:6.2f} GiB {'fit' if fit else 'OOM'}: {what}")
    lo, hi = M.usable_interval()
    assert lo < hi < 16
    assert M.reserve_at(hi) < M.calibrated_reserve() < M.reserve_at(lo)
    assert P.HARDWARE["memory_reserve_fraction"] == pytest.approx(M.calibrated_reserve())
    pairs = [(seen[i], seen[i + 1]) for i in (0, 2, 6)]
    assert all(a[1] and not b[1] and a[2] < b[2] for a, b in pairs)
    flash = replace(M.paper_model("gpt-2.2b"))
    topo = Topology(**M.SERVER)
    costs = {f: stage_plan(Setup(flash, "fp16", flash=f), Layout("2bw", 1, 8, 1, 2, 8),
                           LayerTimes(Setup(flash, "fp16", flash=f),
                                      AnalyticProfile.for_device("v100"), topo), topo)
             for f in (True, False)}
    assert costs[False].max_memory > costs[True].max_memory  # the s x s scores are kept


def test_a_tensor_ring_over_two_servers_runs_at_the_full_nic():
    """bench/paper_table.py's t=16 over two servers: the ring crosses the NIC once per direction,
    so each tensor-parallel all-reduce moves 2(n-1)/n of the activation at the NIC's full 25
    Gbit/s with the NIC's latency per step (not at an eighth of it, the old price)."""
    P = _paper_table()
    topo = P.two_server_topology()
    assert (topo.gpus_per_node, topo.num_nodes, topo.nics_per_node) == (16, 4, 2)
    model = P.paper_model("gpt-3.8b")
    assert model.seq_length == 512
    setup = Setup(model, "fp16")
    b, t = 4, 16
    costs, fwd, _ = LayerTimes(setup, P.PROFILE, topo).get(b, t)
    full = 2.0 * b * model.seq_length * model.hidden_size
    ring = 2 * 15 / 16 * full / (25e9 / 8) + 2 * 15 * 10e-6
    compute = P.PROFILE.layer_times(costs[1], b, t, tokens=b * model.seq_length)[0]
    print(f"t=16 all-reduce of {full / 1e6:.1f} MB: {ring * 1e3:.2f} ms")
    assert fwd[1] - compute == pytest.approx(2 * ring, rel=1e-6)
