"""Issue 32 point 3 (planner): a 2BW layout whose two fp32 gradient buffers do not fit is tried
with one (--2bw-grad-buffers 1): memory from the one-buffer state bytes, time from the one-buffer
table; chosen only where memory forces it, and then the flags and the plan line say so."""
import io
import json
from dataclasses import replace

from megatron_2bw.config import Config, ModelConfig
from megatron_2bw.config.control_flags import TAIL
from megatron_2bw.planner import AnalyticProfile, Topology, predict, search
from megatron_2bw.planner.auto import Plan, grad_buffers_reason, layout_flags
from megatron_2bw.planner.cli import run as plan_run
from megatron_2bw.planner.cost_model import LayerTimes, Setup, stage_plan
from megatron_2bw.planner.memory import state_bytes
from megatron_2bw.planner.topology import GB

MODEL = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32,
                    vocab_size=512)
SHAPE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
         "--vocab-size 512 --num-gpus 2 --gpus-per-node 2 --global-batch-size 8 "
         "--schedules 2bw").split()


def _topo(gb):
    return Topology(num_nodes=1, gpus_per_node=2, gpu_memory_gb=gb)


def test_two_buffers_fit_so_two_are_chosen_and_no_flag_is_printed():
    res = search(MODEL, _topo(0.02), AnalyticProfile(), 8, schedules=("2bw",), top_k=3)
    assert all(e.layout.grad_buffers is None for e in res.ranked)
    assert res.best.layout.kind.grad_buffers == 2 and res.best.plan.two_buffer_memory == 0.0
    assert "--2bw-grad-buffers" not in layout_flags(res.best.layout)
    assert grad_buffers_reason(res.best, res.topology) == ""
    out = io.StringIO()
    assert plan_run(SHAPE + ["--gpu-memory-gb", "0.02"], out) == 0
    assert "--2bw-grad-buffers" not in out.getvalue()
    assert "gradient buffer" not in out.getvalue()


def test_only_one_buffer_fits_so_one_is_chosen_with_the_flag_and_the_reason():
    topo, prof = _topo(0.004), AnalyticProfile()
    usable = topo.usable_memory_gb * GB
    res = search(MODEL, topo, prof, 8, schedules=("2bw",), top_k=3)
    best = res.best
    L = best.layout
    assert L.grad_buffers == 1 and L.kind.grad_buffers == 1 and L.pipeline == 2
    # the same layout with two buffers is over the usable memory; with one it fits
    setup = Setup(MODEL, "fp32", "adam")
    times = LayerTimes(setup, prof, topo)
    two = stage_plan(setup, replace(L, grad_buffers=None), times, topo)
    assert two.max_memory > usable >= best.plan.max_memory
    assert best.plan.two_buffer_memory == two.max_memory
    # memory: the one-buffer state bytes (one buffer and a loss element per slot less 1 buffer)
    for m1, m2 in zip(best.plan.memory, two.memory):
        assert m2["total"] - m1["total"] == m2["grads"] - m1["grads"] > 0
        assert m1["activations"] == m2["activations"] and m1["weights"] == m2["weights"]
    for s, (m1, m2) in enumerate(zip(best.plan.memory, two.memory)):
        n = m2["grads"] // 8 - TAIL  # two buffers: 2 (n + TAIL) fp32 elements
        assert m1["grads"] == state_bytes(n, 2, "fp32", grad_buffers=1)["grads"] == \
            (n + TAIL) * 4 + 2 * 4, s  # one buffer + each slot's loss element
    # time: the one-buffer table (the stage waits for N(t) before batch t+1's first backward)
    assert best.time_per_batch > predict(two).time_per_batch
    # the flags, the plan line and the JSON say so
    assert layout_flags(L).endswith("--2bw-grad-buffers 1")
    reason = grad_buffers_reason(best, topo)
    assert reason.startswith("one gradient buffer (--2bw-grad-buffers 1): two do not fit (")
    assert f"{two.max_memory / GB:.3g} GB > {topo.usable_memory_gb:.3g} GB" in reason
    out = io.StringIO()
    assert plan_run(SHAPE + ["--gpu-memory-gb", "0.004"], out) == 0
    text = out.getvalue()
    assert "--2bw-grad-buffers 1" in text and "two do not fit" in text and " 2bw-g1 " in text
    out = io.StringIO()
    assert plan_run(SHAPE + ["--gpu-memory-gb", "0.004", "--json"], out) == 0
    data = json.loads(out.getvalue())
    assert data["chosen"]["grad_buffers"] == 1 and "--2bw-grad-buffers 1" in data["flags"]
    assert data["grad_buffers"].startswith("one gradient buffer")
    # --auto-plan: the Config gets the mode, and its summary line the reason
    plan = Plan(best, res)
    assert plan.config(Config()).grad_buffers == 1
    assert "two do not fit" in plan.summary()


def test_one_buffer_is_tried_only_for_a_2bw_layout_over_memory():
    topo, prof = _topo(0.004), AnalyticProfile()
    res = search(MODEL, topo, prof, 8, top_k=20, exhaustive=True)
    usable = topo.usable_memory_gb * GB
    for e in res.ranked:
        if e.layout.grad_buffers == 1:
            assert e.layout.schedule == "2bw" and e.plan.two_buffer_memory > usable
        else:
            assert e.plan.two_buffer_memory == 0.0
    # flush/gpipe never get the mode
    flush = search(MODEL, topo, prof, 8, schedules=("flush", "gpipe"), top_k=20, exhaustive=True)
    assert all(e.layout.grad_buffers is None for e in flush.ranked)


def _auto_plan(argv, world, tmp_path, gb):
    from megatron_2bw.config.build import build_config
    from megatron_2bw.config.ds_json import explicit_flags
    from megatron_2bw.planner import plan, planner_inputs
    from megatron_2bw.pretrain import build_parser
    path = tmp_path / "topology.json"
    path.write_text(json.dumps({"num_nodes": 1, "gpus_per_node": world, "gpu_memory_gb": gb}))
    argv = argv + ["--plan-topology", str(path)]
    args = build_parser("gpt").parse_args(argv)
    topo, prof = planner_inputs(args, world)
    lines = []
    cfg = build_config(args, "gpt", world, explicit_flags(argv),
                       planner=lambda c: plan(c, topo, prof, log=lines.append)).config
    return cfg, lines


def test_auto_plan_sets_one_buffer_where_only_it_fits_and_keeps_a_given_mode(tmp_path):
    shape = ("--mock-data --num-layers 4 --hidden-size 64 --num-attention-heads 4 "
             "--seq-length 32 --vocab-size 512 --global-batch-size 8 "
             "--pipeline-schedule 2bw").split()
    cfg, lines = _auto_plan(shape, 2, tmp_path, 0.004)
    assert cfg.grad_buffers == 1 and "--2bw-grad-buffers 1" in lines[0]
    assert "two do not fit" in lines[0]
    roomy, lines = _auto_plan(shape, 2, tmp_path, 0.02)
    assert roomy.grad_buffers is None and "--2bw-grad-buffers" not in lines[0]
    # a given --2bw-grad-buffers 2 is kept: the planner finds a layout that fits two
    two, lines = _auto_plan(shape + ["--2bw-grad-buffers", "2"], 2, tmp_path, 0.004)
    assert two.grad_buffers == 2 and "--2bw-grad-buffers" not in lines[0]
    def layout(c):
        return (c.parallel.pipeline, c.parallel.data, c.batch.micro_batch_size,
                c.model.recompute_granularity, c.parallel.distributed_optimizer)
    assert layout(two) != layout(cfg)  # the one-buffer layout does not fit two buffers


def _times(model, topo, L):
    setup = Setup(model, "fp32", "adam")
    times = LayerTimes(setup, AnalyticProfile(), topo)
    return [predict(stage_plan(setup, replace(L, grad_buffers=g), times, topo)).time_per_batch
            for g in (None, 1)]


def test_one_buffer_is_never_faster_than_two_at_the_same_layout():
    """Why the planner tries one buffer only where two do not fit: at an equal layout the
    one-buffer table only adds a wait (S(t) before batch t+1's first backward), so its time is
    never below two buffers' and its only gain is memory (a sweep of d, m, w, the distributed
    optimizer and recomputation)."""
    model = ModelConfig(num_layers=8, hidden_size=64, num_attention_heads=4, seq_length=32,
                        vocab_size=512)
    topo = Topology(num_nodes=1, gpus_per_node=8, gpu_memory_gb=16)
    res = search(model, topo, AnalyticProfile(), 64, schedules=("2bw",), exhaustive=True,
                 top_k=10 ** 6)
    swept = [e.layout for e in res.ranked if e.layout.pipeline > 1][::7]
    assert len(swept) > 20 and {L.pipeline for L in swept} >= {2, 4, 8}
    assert {L.distributed_optimizer for L in swept} == {False, True}
    for L in swept:
        two, one = _times(model, topo, L)
        assert one >= two * (1 - 1e-9), L


def test_at_the_peers_shape_where_one_buffer_loses_the_planner_keeps_two():
    """Issue 32's bar: where one buffer costs more than 3% of 2BW's samples/s, the planner must
    pick two. bench/peers.py's transformer shape (4 layers, hidden 256, seq 64, micro batch 8,
    d=2, m=8) on two roomy devices: the simulator puts one buffer at < 0.97 of two's throughput
    (the stage waits for N(t)), and the planner's 2BW pick keeps two buffers; where two do not
    fit it takes one on the first stage (--2bw-grad-buffers first, about free) and says why."""
    model = ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=64,
                        vocab_size=512)
    topo = _topo(16)
    res = search(model, topo, AnalyticProfile(), 64, schedules=("2bw",), pipeline_sizes=(2,),
                 micro_batches=(8,))
    L = res.best.layout
    assert (L.pipeline, L.num_microbatches, L.grad_buffers) == (2, 8, None)
    two, one = _times(model, topo, L)
    assert two / one < 0.97
    setup = Setup(model, "fp32", "adam")
    times = LayerTimes(setup, AnalyticProfile(), topo)
    need = {g: stage_plan(setup, replace(L, grad_buffers=g), times, topo).max_memory
            for g in (None, "first", 1)}
    # stage 0 (d microbatches in flight) is the fullest: one buffer there is all one buffer
    # everywhere would save from the peak, at about no time (the first stage posts N(t) last)
    assert need[None] > need["first"] == need[1]
    first = stage_plan(setup, replace(L, grad_buffers="first"), times, topo)
    assert predict(first).time_per_batch <= two * (1 + 1e-3)
    tight = Topology(num_nodes=1, gpus_per_node=2, gpu_memory_gb=(need[None] + need["first"])
                     / 2 / GB / (topo.usable_memory_gb / 16))
    forced = search(model, tight, AnalyticProfile(), 64, schedules=("2bw",),
                    pipeline_sizes=(2,), micro_batches=(8,), recompute=(False,))
    assert forced.best.layout.grad_buffers == "first"
    why = grad_buffers_reason(forced.best, tight)
    assert "two do not fit" in why and "--2bw-grad-buffers first" in why
