"""Issue 32, Build point 1, without processes: reduction buckets of whole parameters
(optim/shard_layout.py `region_lengths`, Megatron's default size), the stage's buckets and which
of them may start inside the last backward (pipeline/weights.py, pipeline/grad_reduce.py), the
flags, and the cost model's price of a reduction started in the last backward (the processes:
tests/distributed/test_grad_buckets.py)."""
from dataclasses import replace

import pytest
import torch
from torch import nn

from megatron_2bw.config import ConfigError, ModelConfig
from megatron_2bw.config.checks import check_config
from megatron_2bw.optim.shard_layout import bucket_elements, padded_numel, region_lengths
from megatron_2bw.pipeline.grad_reduce import GradReduction
from megatron_2bw.pipeline.weights import VersionedWeights
from megatron_2bw.planner import AnalyticProfile, Topology, predict, search
from megatron_2bw.planner.cost_model import LayerTimes, Setup, stage_plan
from megatron_2bw.planner.reductions import _after_last_backward
from megatron_2bw.testing.verify import parse


def test_buckets_hold_whole_parameters_in_layout_order():
    assert region_lengths([3, 4, 5], 0, None) == [12]
    assert region_lengths([3, 4, 5], 0, 7) == [7, 5]
    assert region_lengths([3, 4, 5], 0, 2) == [3, 4, 5]  # a parameter larger: a bucket alone
    assert region_lengths([3, 4, 5, 1], 1, 9) == [3, 9, 1]  # the tied weight: its own region
    assert region_lengths([3], 1, 5) == [3, 0] and region_lengths([], 0, 5) == [0]


def test_the_default_bucket_is_megatron_s():
    assert bucket_elements(None, 8) == 40_000_000
    assert bucket_elements(None, 64) == 64_000_000
    assert bucket_elements(3000, 64) == 3000
    with pytest.raises(ValueError, match="--ddp-bucket-size must be a positive"):
        bucket_elements(0, 2)


def test_the_memory_model_pads_each_bucket_like_the_engine():
    """One bucket: exact; more: each padded to a multiple of w, within w - 1 per bucket."""
    assert padded_numel(31, 10, 4) == padded_numel(31, 10, 4, 100) == 36
    engine = VersionedWeights(_stage(), 1, "fp32", "cpu", shard_count=4, bucket=300)
    n = sum(p.numel() for p in _stage().parameters())
    assert len(engine.layout.regions) >= 3
    assert abs(padded_numel(n, 0, 4, 300) - engine.numel) <= 3 * len(engine.layout.regions)


class _Comm:
    def all_reduce(self, tensor, group, async_op=False):
        return ("all-reduce", tensor.numel())


class _Grid:
    """What GradReduction asks of a grid: w replicas of a one-stage pipeline, a dp group."""

    def __init__(self, data):
        self.data, self.pipeline, self.comm = data, 1, _Comm()

    def group(self, kind):
        return object() if kind == "dp" and self.data > 1 else None


def _stage(norm_sp=False):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 16), nn.Linear(16, 4))
    if norm_sp:
        for p in m[1].parameters():
            p.sequence_parallel = True
    return m


@pytest.mark.parametrize("sharded", [False, True])
def test_buckets_are_the_regions_and_every_parameter_lies_in_one(sharded):
    w = VersionedWeights(_stage(), 2, "fp32", "cpu", shard_count=2 if sharded else 1,
                         bucket=300)
    r = GradReduction(w, _Grid(2), sequence_parallel=False)
    assert [(lo, hi) for lo, hi, _ in r.buckets] == [(g.lo, g.hi) for g in w.layout.regions]
    assert len(r.buckets) >= 3 and r.overlap
    assert all(len(bs) == 1 for bs in r._of_param)
    assert sum(r._params_in) == len(w.offsets)
    for piece, (_, _, p) in zip(w.pieces, r.buckets):
        assert piece == p


def test_what_r_starts_itself():
    """Sequence-parallel buckets wait for R; so does everything under the low-precision buffer,
    without a data-parallel group, and with --no-overlap-grad-reduce."""
    grid = _Grid(2)
    w = VersionedWeights(_stage(norm_sp=True), 1, "fp32", "cpu", bucket=300)
    r = GradReduction(w, grid, sequence_parallel=True)
    lo, hi = w.sequence_parallel_range
    late = [b for b, (a, z, _) in enumerate(r.buckets) if a < hi and lo < z]
    assert late and all(r._params_in[b] == 0 for b in late) and r.overlap
    assert not GradReduction(w, grid, sequence_parallel=False, overlap=False).overlap
    buffered = VersionedWeights(_stage(), 1, "bf16", "cpu", bucket=300,
                                grad_accumulation="buffer")
    assert not GradReduction(buffered, grid, sequence_parallel=False).overlap
    alone = GradReduction(w, _Grid(1), sequence_parallel=False)
    assert alone.buckets == [] and not alone.overlap


def test_the_hooks_live_for_the_last_backward_only():
    w = VersionedWeights(_stage(), 1, "fp32", "cpu", bucket=300)
    r = GradReduction(w, _Grid(2), sequence_parallel=False,
                      microbatches=3)
    started = []
    r._start = lambda buf, b, tail=False: started.append(b) or b
    for mb in range(3):
        r.before_backward(0, 0)
        assert bool(r._handles) == (mb == 2)
        w.modules[0](torch.randn(2, 16)).sum().backward()
        r.disarm()
    assert sorted(started) == list(range(len(r.buckets)))
    assert r.early_buckets == len(r.buckets) and not r._handles
    works = r.reduce(0, w.grads[0])  # the buckets' works, then the tail's own all-reduce
    assert works == sorted(started) + [("all-reduce", w.grads[0].numel() - w.numel)]


def test_the_flags():
    cfg, _ = parse(["--ddp-bucket-size", "5000"])
    assert cfg.parallel.grad_bucket_size == 5000 and cfg.parallel.overlap_grad_reduce
    cfg, _ = parse(["--overlap-grad-reduce"])  # Megatron's flag: the default here
    assert cfg.parallel.grad_bucket_size is None and cfg.parallel.overlap_grad_reduce
    cfg, _ = parse(["--no-overlap-grad-reduce"])
    assert not cfg.parallel.overlap_grad_reduce
    with pytest.raises(ConfigError, match=r"^--ddp-bucket-size must be a positive .* got 0"):
        check_config(cfg.replace(parallel={"grad_bucket_size": 0}), None)


MODEL = ModelConfig(num_layers=8, hidden_size=1024, num_attention_heads=16, seq_length=512,
                    vocab_size=32000)


def test_the_last_backward_hides_all_but_the_last_bucket_or_the_link_s_excess():
    s = Setup(MODEL, "fp32")
    assert _after_last_backward(10.0, 4.0, 10 ** 8, 2, s) == pytest.approx(10 - 4 * 2 / 3)
    assert _after_last_backward(1.0, 4.0, 10 ** 8, 2, s) == pytest.approx(1 / 3)
    assert _after_last_backward(1.0, 4.0, 10 ** 7, 2, s) == 1.0  # one bucket: nothing hides
    assert _after_last_backward(1.0, 4.0, 10 ** 8, 1, s) == 1.0
    for late in (replace(s, overlap_grad_reduce=False),
                 replace(s, dtype="bf16", grad_accumulation="buffer")):
        assert _after_last_backward(1.0, 4.0, 10 ** 8, 2, late) == 1.0
    assert _after_last_backward(1.0, 4.0, 10 ** 7, 2, replace(s, bucket=10 ** 6)) == \
        pytest.approx(0.1)


def test_a_flush_layout_with_data_parallelism_is_faster_with_early_buckets():
    topo = Topology(num_nodes=2, gpus_per_node=4, gpu_memory_gb=80, inter_node_bandwidth_gbps=25)
    res = search(MODEL, topo, AnalyticProfile(), 64, schedules=("flush",), top_k=50,
                 exhaustive=True)
    L = next(e.layout for e in res.ranked if e.layout.data > 1 and e.layout.pipeline > 1)
    times = {}
    for overlap in (True, False):
        setup = Setup(MODEL, "fp32", "adam", overlap_grad_reduce=overlap, bucket=10 ** 6)
        plan = stage_plan(setup, L, LayerTimes(setup, AnalyticProfile(), topo), topo)
        times[overlap] = predict(plan).time_per_batch
        assert all(n <= a for n, a in zip(plan.norm, plan.allreduce))
    assert times[True] < times[False]
