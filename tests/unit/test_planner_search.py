"""Planner search: equals exhaustive simulation, is fast, is monotone in resources, fails clearly;
tools/plan.py and the planner as a Config -> Config step (planner/auto.py)."""
import io
import json
import random
from dataclasses import replace

import pytest

from megatron_2bw.config import ModelConfig
from megatron_2bw.models.flops import named_model
from megatron_2bw.planner import AnalyticProfile, PlanError, Topology, predict, search
from megatron_2bw.planner.cli import main as plan_main
from megatron_2bw.planner.cli import run as plan_run
from megatron_2bw.planner.topology import GB
from megatron_2bw.planner.cost_model import LayerTimes, Setup, compute_floor, stage_plan
from megatron_2bw.planner.search import TIE, enumerate_layouts
from megatron_2bw.planner.simulate import steady_increment
from megatron_2bw.planner.topology import GB


def _model(layers, hidden=64, seq=32, vocab=512):
    return ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=4,
                       seq_length=seq, vocab_size=vocab)


def _problems(n, seed):
    rng = random.Random(seed)
    for _ in range(n):
        gpn = rng.choice([1, 2, 4])
        topo = Topology(num_nodes=rng.choice([1, 2]), gpus_per_node=gpn,
                        gpu_memory_gb=rng.choice([0.004, 0.01, 0.05, 1.0]),
                        intra_node_bandwidth_gbps=rng.choice([10, 100, 1000]),
                        inter_node_bandwidth_gbps=rng.choice([0.5, 5, 50]),
                        intra_node_latency_us=rng.choice([1, 20]),
                        inter_node_latency_us=rng.choice([5, 100]))
        model = _model(rng.choice([2, 3, 4, 6]), rng.choice([32, 64, 128]), rng.choice([16, 64]))
        prof = AnalyticProfile(device_tflops=rng.choice([0.05, 0.5, 5.0]), efficiency=0.5,
                               memory_bandwidth_gb_per_s=rng.choice([1.0, 20.0]))
        yield model, topo, prof, rng.choice([4, 8, 16]), rng.choice(["fp32", "bf16"])


def _exhaustive(model, topo, prof, batch, dtype):
    """Every layout that fits, fully simulated (no extrapolation, no pruning)."""
    setup = Setup(model, dtype, "adam")
    times = LayerTimes(setup, prof, topo)
    best = None
    for layout in enumerate_layouts(model, topo, batch):
        plan = stage_plan(setup, layout, times, topo)
        if plan.max_memory > topo.usable_memory_gb * GB and layout.schedule == "2bw":
            layout = replace(layout, grad_buffers=1)  # two buffers over memory: try one
            plan = stage_plan(setup, layout, times, topo)
        if plan.max_memory > topo.usable_memory_gb * GB:
            continue
        est = predict(plan, full=True)
        if layout.schedule != "2bw":  # drained every batch: the simulation is the steady state
            assert steady_increment(plan) >= est.lower_bound * (1 - 1e-9), layout
        # the documented ranking: time (ties within TIE), the synchronous schedule, memory
        key = (float(f"{est.time_per_batch:.6g}"), not layout.kind.synchronous, plan.max_memory,
               layout.describe(), est.time_per_batch)
        best = min(best, key) if best else key
    return best


@pytest.mark.parametrize("problems,at_least",
                         [(12, 6), pytest.param(40, 20, marks=pytest.mark.slow)])
def test_search_choice_equals_exhaustive_simulation(problems, at_least):
    checked = same = 0
    for model, topo, prof, batch, dtype in _problems(problems, seed=1):
        try:
            res = search(model, topo, prof, batch, dtype=dtype, top_k=3)
        except PlanError as e:
            assert "does not fit" in str(e) or "no valid layout" in str(e)
            assert _exhaustive(model, topo, prof, batch, dtype) is None
            continue
        best = _exhaustive(model, topo, prof, batch, dtype)
        assert best is not None
        # as fast, fully simulated, as the exhaustive best: another layout only on a time tie
        chosen = predict(res.best.plan, full=True).time_per_batch
        assert chosen == pytest.approx(best[4], rel=TIE)
        same += res.best.layout.describe() == best[3]
        everything = search(model, topo, prof, batch, dtype=dtype, exhaustive=True)
        assert everything.best.layout == res.best.layout
        assert [e.layout for e in everything.ranked[:3]] == [e.layout for e in res.ranked]
        checked += 1
    assert checked >= at_least
    assert same >= 0.9 * checked, "ties are rare: nearly always the very same layout"


def test_search_is_fast_for_64_gpus_and_32_blocks():
    model = named_model("gpt-2.7b")
    assert model.num_layers == 32
    topo = Topology(num_nodes=8, gpus_per_node=8, gpu_memory_gb=80)
    res = search(model, topo, AnalyticProfile(), 512, dtype="bf16")
    # fast by its work, not by a clock (no test depends on timing or load): of thousands of
    # layouts, most are beaten on their compute floor before being planned, and of the
    # hundreds that fit, the lower bound leaves only a handful to simulate
    print(f"{res.considered} layouts, {res.examined} planned, {res.fitting} fit, "
          f"{res.simulated} simulated")
    assert res.considered > 1000 and res.examined < res.considered / 3
    assert res.fitting > 100 and res.simulated <= 16
    assert res.best.layout.num_gpus == 64


def test_more_memory_or_a_faster_link_never_predicts_slower():
    checked = 0
    for model, topo, prof, batch, dtype in _problems(40, seed=2):
        try:
            base = search(model, topo, prof, batch, dtype=dtype, top_k=1).best.time_per_batch
        except PlanError:
            continue
        for better in (replace(topo, gpu_memory_gb=topo.gpu_memory_gb * 4),
                       replace(topo, inter_node_bandwidth_gbps=topo.inter_node_bandwidth_gbps * 10),
                       replace(topo, inter_node_latency_us=topo.inter_node_latency_us / 10)):
            t = search(model, better, prof, batch, dtype=dtype, top_k=1).best.time_per_batch
            assert t <= base * (1 + 1e-9)
        checked += 1
    assert checked >= 20


def test_layouts_respect_the_rules():
    model = _model(4)
    topo = Topology(num_nodes=2, gpus_per_node=4)
    layouts = list(enumerate_layouts(model, topo, 16))
    assert layouts
    for L in layouts:
        assert L.tensor * L.pipeline * L.data == 8 and 4 % L.tensor == 0
        assert L.micro_batch * L.num_microbatches * L.data == 16
        assert L.schedule != "2bw" or L.num_microbatches >= L.pipeline
        assert L.pipeline <= 4
    assert {L.rank_order for L in layouts} == {"tp-dp-pp", "tp-pp-dp"}
    assert {L.schedule for L in layouts} == {"2bw", "flush", "gpipe"}
    assert {L.recompute for L in layouts} == {False, True}


# ---- bad inputs ------------------------------------------------------------------------------


def test_nothing_fits_names_the_smallest_footprint():
    topo = Topology(num_nodes=1, gpus_per_node=2, gpu_memory_gb=10)
    with pytest.raises(PlanError, match=r"does not fit: smallest footprint \d+\.\d+ GB > 9\.00 GB"):
        search(named_model("gpt-13b"), topo, AnalyticProfile(), 64, dtype="bf16")


@pytest.mark.parametrize("argv,match", [
    ("--gpu-memory-gb 0 --global-batch-size 8", "--gpu-memory-gb must be > 0, got 0"),
    ("--num-gpus 12 --gpus-per-node 8 --global-batch-size 8",
     "--num-gpus 12 is not divisible by --gpus-per-node 8"),
    ("--model gpt-175b --num-gpus 2 --gpu-memory-gb 16 --global-batch-size 8",
     "does not fit: smallest footprint"),
    ("--num-gpus 4 --global-batch-size 3 --tensor-sizes 1", "no valid layout for 4 GPUs"),
    ("--num-gpus 2 --global-batch-size 8 --schedules 2bw,1f1b", "unknown schedule '1f1b'"),
    ("--model gpt-1.3 --global-batch-size 8", "did you mean gpt-1.3b"),
    ("--num-gpus 2", "--global-batch-size is required"),
    ("--num-gpus 2 --global-batch-size 8 --profile /nonexistent.json",
     "/nonexistent.json: no such file; give a profile JSON"),
    ("--num-gpus 2 --global-batch-size 8 --hidden-dropout 1.5",
     "--hidden-dropout must be in [0, 1), got 1.5"),
    ("--num-gpus 2 --global-batch-size 8 --attention-dropout -0.1",
     "--attention-dropout must be in [0, 1), got -0.1"),
    ("--num-gpus 2 --global-batch-size 8 --nic-bandwidth-gbps 25",
     "--nic-bandwidth-gbps 25 needs --nics-per-node N"),
    ("--num-gpus 2 --global-batch-size 8 --memory-reserve-fraction 1",
     "--memory-reserve-fraction must be in [0, 1), got 1"),
])
def test_cli_bad_inputs_are_one_line(argv, match, capsys):
    assert plan_main(argv.split()) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1 and err.startswith("error: ")


# ---- tools/plan.py ---------------------------------------------------------------------------


def test_cli_table_and_json():
    argv = "--model gpt-1.3b --num-nodes 2 --gpus-per-node 8 --global-batch-size 128 --bf16"
    out = io.StringIO()
    assert plan_run(argv.split(), out) == 0
    text = out.getvalue()
    assert "samples/s" in text and "chosen" in text and "--pipeline-model-parallel-size" in text
    out = io.StringIO()
    assert plan_run(argv.split() + ["--json", "--top", "3"], out) == 0
    data = json.loads(out.getvalue())
    chosen = data["chosen"]
    assert chosen["tensor"] * chosen["pipeline"] * chosen["data"] == 16
    assert len(data["candidates"]) == 3 and data["candidates"][0] == chosen
    assert f"--micro-batch-size {chosen['micro_batch_size']}" in data["flags"]
    assert chosen["partition"][0] == 0 and chosen["partition"][-1] == 26


def test_cli_measured_profile_round_trip(tmp_path):
    path = str(tmp_path / "cpu.json")
    shape = "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 8 --vocab-size 64"
    said = io.StringIO()
    assert plan_run(f"{shape} --profile-out {path} --profile-micro-batches 1,2".split(),
                    said) == 0
    assert "fitted curve: half efficiency at" in said.getvalue()
    out = io.StringIO()
    assert plan_run(f"{shape} --profile {path} --num-gpus 2 --gpu-memory-gb 1 "
                    "--global-batch-size 8 --json".split(), out) == 0
    assert json.loads(out.getvalue())["chosen"]["samples_per_s"] > 0
    with pytest.raises(PlanError, match="was measured for hidden_size 32, not 64"):
        plan_run(f"--profile {path} --num-gpus 2 --global-batch-size 8".split(), io.StringIO())


def _flags_config(argv, world, planned=True):
    from megatron_2bw.config.build import build_config
    from megatron_2bw.config.ds_json import explicit_flags
    from megatron_2bw.planner import plan, planner_inputs
    from megatron_2bw.pretrain import build_parser
    args = build_parser("gpt").parse_args(argv)
    topo, prof = planner_inputs(args, world)
    planner = (lambda cfg: plan(cfg, topo, prof)) if planned else None
    return build_config(args, "gpt", world, explicit_flags(argv), planner=planner).config


def test_plan_returns_a_new_valid_config_keeping_what_the_flags_fix():
    shape = ("--mock-data --num-layers 4 --hidden-size 64 --num-attention-heads 4 "
             "--seq-length 32 --global-batch-size 32").split()
    cfg = _flags_config(shape, 4)
    p = cfg.parallel
    assert p.tensor * p.pipeline * p.data == 4 and cfg.batch.global_batch_size == 32
    assert len(p.partition) == p.pipeline + 1 and p.partition[-1] == 6
    assert cfg.validate(4) == cfg
    # typed layout flags stay as typed; the planner chooses the rest
    fixed = _flags_config(shape + ["--pipeline-model-parallel-size", "2", "--micro-batch-size",
                                   "2", "--pipeline-schedule", "2bw"], 4)
    assert (fixed.parallel.pipeline, fixed.batch.micro_batch_size, fixed.schedule) == \
        (2, 2, "2bw")
    assert fixed.source_of("parallel.pipeline") == "--pipeline-model-parallel-size 2"
    # an odd vocabulary cannot be split by tensor parallelism: the plan must avoid t > 1
    odd = _flags_config(shape + ["--vocab-size", "509", "--num-attention-heads", "8"], 8)
    assert odd.parallel.tensor == 1
    with pytest.raises(PlanError, match="--auto-plan needs the global batch: give "
                                        "--global-batch-size or train_batch_size"):
        _flags_config(shape[:-2], 4)


def test_the_planner_searches_only_free_fields():
    """plan() is Config -> Config: the input is not changed, fixed paths are kept."""
    from megatron_2bw.config import Config, Fixed, ModelConfig
    from megatron_2bw.planner import plan
    base = Config(model=ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4,
                                    seq_length=16)).replace(batch={"global_batch_size": 16})
    fixed = base.replace(fixed=(Fixed("parallel.data", "--data-parallel-size 2", 2),
                                Fixed("batch.num_microbatches", "gas=4", 4)))
    out = plan(fixed, Topology(num_nodes=1, gpus_per_node=4), AnalyticProfile())
    assert (out.parallel.data, out.num_microbatches, out.batch.micro_batch_size) == (2, 4, 2)
    assert out.parallel.tensor * out.parallel.pipeline == 2 and out.fixed == fixed.fixed
    assert fixed.parallel.data is None and fixed.parallel.partition is None  # unchanged


def test_a_time_tie_goes_to_the_synchronous_schedule_then_to_memory():
    from types import SimpleNamespace

    from megatron_2bw.planner.cost_model import Layout
    from megatron_2bw.planner.search import _key

    def est(schedule, time, memory):
        return SimpleNamespace(time_per_batch=time, layout=Layout(schedule, 1, 2, 2, 1, 4),
                               plan=SimpleNamespace(max_memory=memory))
    tied = [est("2bw", 1.0, 1.0), est("gpipe", 1.0 + TIE / 10, 3.0), est("flush", 1.0, 2.0)]
    assert [e.layout.schedule for e in sorted(tied, key=_key)] == ["flush", "gpipe", "2bw"]
    faster = est("2bw", 1.0 - 10 * TIE, 1.0)  # a real gain is not a tie
    assert sorted(tied + [faster], key=_key)[0] is faster


def test_one_stage_asynchronous_layouts_only_when_no_synchronous_schedule_is_allowed():
    topo = Topology(num_nodes=1, gpus_per_node=4)
    layouts = list(enumerate_layouts(_model(4), topo, 16))
    assert not [L for L in layouts if L.pipeline == 1 and not L.kind.synchronous]
    assert any(L.pipeline > 1 and not L.kind.synchronous for L in layouts)
    only_2bw = list(enumerate_layouts(_model(4), topo, 16, schedules=("2bw",)))
    assert any(L.pipeline == 1 for L in only_2bw)  # the user asked for 2bw: it is offered


PAPER = ("--model gpt-3.8b --num-nodes 8 --gpus-per-node 8 --gpu-memory-gb 16 "
         "--inter-node-bandwidth-gbps 25 --global-batch-size 512 --fp16 --top 1 --json").split()
SMALL = ("--model gpt-1.3b --num-nodes 1 --gpus-per-node 8 --gpu-memory-gb 16 "
         "--global-batch-size 64 --bf16 --top 1 --json").split()


def _plan_json(argv):
    out = io.StringIO()
    assert plan_run(argv, out) == 0
    return json.loads(out.getvalue())


@pytest.mark.parametrize("argv", [
    pytest.param(PAPER, marks=pytest.mark.slow, id="paper"),  # ~30 s per search
    pytest.param(SMALL, id="small")])
def test_plan_says_whether_it_uses_the_distributed_optimizer_and_why(argv):
    """The paper's 3.8B GPT on 8 x 8 16 GB GPUs (and a small cluster): the statement matches the
    flags, and the layout it compares with is the best plan of the other choice, with its real
    memory and slowdown."""
    data = _plan_json(argv)
    chosen, why = data["chosen"], data["distributed_optimizer"]
    uses = chosen["distributed_optimizer"]
    assert why.startswith(f"distributed optimizer: {'yes' if uses else 'no'}: "), why
    assert ("--use-distributed-optimizer" in data["flags"]) == uses
    other = _plan_json(argv + ["--distributed-optimizer", "on" if not uses else "off"])["chosen"]
    assert other["distributed_optimizer"] != uses
    slower = other["time_per_batch_s"] / chosen["time_per_batch_s"] - 1
    assert f"max {max(other['memory_gb_per_stage']):.2f} GB) is {slower:.1%} slower" in why, why
    assert f"w{other['data']} b{other['micro_batch_size']}" in why
    if uses:
        assert f"(1/{chosen['data']} of the stage's)" in why


def test_plan_without_replicas_says_there_is_nothing_to_shard():
    argv = "--model gpt-1.3b --num-gpus 2 --global-batch-size 8 --bf16 --tensor-sizes 2"
    out = io.StringIO()
    assert plan_run(argv.split(), out) == 0
    assert "distributed optimizer: no: the chosen layout has one data-parallel replica" in \
        out.getvalue()


def test_the_planner_turns_on_the_distributed_optimizer_and_recomputation_when_they_fit_it():
    """GPT 1.3B, bf16 2BW at d=2 w=2 on 18 GB GPUs: without the distributed optimizer nothing
    fits, even with full recomputation; with it, full recomputation fits and is chosen (two
    gradient buffers). With fewer buffers allowed (issue 32 point 3) the 4 bytes per parameter
    one buffer on the first stage frees there let the distributed optimizer run without
    recomputation, which is faster.
    All of that with the low-precision gradient buffer (--grad-accumulation buffer); without it
    (the default fp32 accumulation) its 2 bytes per parameter are enough for that with two.
    On time-balanced stages throughout (fit_partition=False); the last check lets the search
    move a layer off the fuller stage instead, which fits two buffers without recomputation."""
    topo = Topology(num_nodes=1, gpus_per_node=4, gpu_memory_gb=18)
    args = (named_model("gpt-1.3b"), topo, AnalyticProfile(), 64)
    kw = dict(dtype="bf16", schedules=("2bw",), tensor_sizes=(1,), pipeline_sizes=(2,),
              one_buffer=False, grad_accumulation="buffer", fit_partition=False)
    with pytest.raises(PlanError, match="does not fit"):
        search(*args, distributed_optimizer=(False,), **kw)
    two = search(*args, **kw).best
    L = two.layout
    assert (L.data, L.distributed_optimizer, L.recompute, L.grad_buffers) == (2, True, True, None)
    with pytest.raises(PlanError, match="does not fit"):
        search(*args, recompute=(False, "selective"), **kw)
    one = search(*args, **dict(kw, one_buffer=True)).best
    L = one.layout
    # one buffer on the first stage (the fullest: d microbatches in flight) is enough here
    assert (L.data, L.distributed_optimizer, L.recompute, L.grad_buffers) == \
        (2, True, False, "first")
    assert one.time_per_batch < two.time_per_batch
    hooked = search(*args, **dict(kw, grad_accumulation="fp32")).best
    L = hooked.layout
    assert (L.data, L.distributed_optimizer, L.recompute, L.grad_buffers) == (2, True, False, None)
    moved = search(*args, **dict(kw, fit_partition=True)).best
    L, usable = moved.layout, topo.usable_memory_gb * GB
    assert (L.data, L.distributed_optimizer, L.recompute, L.grad_buffers) == (2, True, False, None)
    assert moved.plan.max_memory <= usable < moved.plan.balanced_memory
    assert moved.time_per_batch < two.time_per_batch


def test_sequence_parallelism_needs_t_and_the_distributed_optimizer_w():
    layouts = list(enumerate_layouts(_model(4), Topology(num_nodes=1, gpus_per_node=4), 16))
    assert {(L.sequence_parallel, L.distributed_optimizer) for L in layouts} == \
        {(a, b) for a in (False, True) for b in (False, True)}
    assert all(L.tensor > 1 for L in layouts if L.sequence_parallel)
    assert all(L.data > 1 for L in layouts if L.distributed_optimizer)
    assert {L.recompute_name for L in layouts} == {"no", "sel", "full"}



def test_the_compute_floor_is_below_every_plans_bound_and_prediction():
    """The search plans layouts in the order of their compute floor and stops on it: it must
    never exceed a layout's lower bound (nor its variants'), or a better layout is skipped."""
    checked = 0
    for model, topo, prof, gb, dtype in _problems(20, 7):
        setup = Setup(model, dtype)
        times = LayerTimes(setup, prof, topo)
        for L in enumerate_layouts(model, topo, gb):
            plan = stage_plan(setup, L, times, topo)
            floor = compute_floor(L, times)
            assert floor <= plan.lower_bound() * (1 + 1e-12), L.describe()
            for variant in ([replace(L, grad_buffers=1)] if L.kind.num_slots == 2 else []) + (
                    [replace(L, microbatches_per_flush=1)] if L.kind.splits_into_flushes else []):
                assert floor <= stage_plan(setup, variant, times, topo).lower_bound() * (
                    1 + 1e-12), variant.describe()
            checked += 1
    assert checked > 500


def test_fit_only_answers_whether_anything_fits_without_simulating():
    for model, topo, prof, gb, dtype in _problems(30, 11):
        try:
            full = search(model, topo, prof, gb, dtype=dtype, top_k=1)
        except PlanError as e:
            with pytest.raises(PlanError, match=str(e).split(":")[0]):
                search(model, topo, prof, gb, dtype=dtype, fit_only=True)
            continue
        quick = search(model, topo, prof, gb, dtype=dtype, fit_only=True)
        est = quick.best
        assert quick.simulated == 0 and est.source == "bound" and len(quick.ranked) == 1
        assert est.plan.max_memory <= topo.usable_memory_gb * GB
        assert est.time_per_batch == est.plan.lower_bound()  # a fit, not necessarily the best
        assert full.best.plan.max_memory <= topo.usable_memory_gb * GB
