"""The paper's hardware and stack, and the planner's estimate of each technique on it (the
machinery of bench/paper_table.py: see its docstring and bench/paper_memory.py).

`best` is the planner's best layout of some schedules in the paper's space, `tensor_only` tensor
model parallelism without pipelining, `no_pipelining` inter-layer model parallelism; every answer
is cached until `set_usable` changes the memory per GPU.
"""
from __future__ import annotations

import json

from megatron_2bw.planner.cost_model import LayerTimes, Setup, stage_plan
from megatron_2bw.planner.profile import AnalyticProfile
from megatron_2bw.planner.search import enumerate_layouts, search
from megatron_2bw.planner.topology import GB, PlanError, Topology
from paper_memory import (FLASH, GRAD_ACCUMULATION, GRAD_REDUCE_BYTES, calibrated_reserve,
                          paper_model, reserve_at)

HARDWARE = dict(num_nodes=8, gpus_per_node=8, gpu_memory_gb=16, intra_node_bandwidth_gbps=1200,
                inter_node_bandwidth_gbps=25, nics_per_node=1, nic_bandwidth_gbps=25,
                memory_reserve_fraction=calibrated_reserve())
# the speed rows compare the paper's 2BW, a gradient buffer per weight version (one_buffer=False:
# no --2bw-grad-buffers first/1 fallback, which would let our 2BW fit layouts the paper's did
# not); the largest-model row is our engine's capacity and allows them and partitions that fit
# (`largest_trainable`)
# and stages balanced in time, as the paper's planner cuts them (fit_partition=False)
SPACE = dict(dtype="fp16", tensor_sizes=(1,), distributed_optimizer=(False,),
             sequence_parallel=(False,), recompute=(False, True), top_k=1,
             grad_reduce_bytes=GRAD_REDUCE_BYTES, one_buffer=False, flash=FLASH,
             grad_accumulation=GRAD_ACCUMULATION, fit_partition=False)
PROFILE = AnalyticProfile.for_device("v100")
_CACHE: dict = {}
_WHY: dict = {}  # schedules -> why nothing fitted (the planner's one line)


def best(model_name: str, batch: int, schedules, topo=None, key=(), **kw):
    """The best Estimate of `schedules` (None: nothing fits); `key` names `topo`."""
    key = (model_name, batch, tuple(schedules), json.dumps(kw, sort_keys=True, default=str),
           key)
    if key not in _CACHE:
        args = dict(SPACE, **kw)
        try:
            _CACHE[key] = search(paper_model(model_name), topo or Topology(**HARDWARE), PROFILE,
                                 batch, schedules=tuple(schedules), **args).best
        except PlanError as e:
            _CACHE[key] = None
            why = str(e).split(":")[1].strip() if ":" in str(e) else str(e)
            _WHY.setdefault(tuple(schedules), f"{why} at {model_name} B={batch}")  # the first
    return _CACHE[key]


def ratio(a, b) -> float | None:
    return None if a is None or b is None else a.samples_per_s / b.samples_per_s


def tensor_only(model_name: str, batch: int, t: int, nodes: int = 8, **kw):
    """Tensor model parallelism alone over t GPUs (no pipelining), replicated w = GPUs / t
    times; t = 16 spans two servers: its all-reduces run over the servers' shared NIC."""
    topo = two_server_topology() if t > HARDWARE["gpus_per_node"] else _topology(nodes)
    return best(model_name, batch, ("flush",), topo, key=("tensor", t, nodes),
                **dict(kw, tensor_sizes=(t,), pipeline_sizes=(1,)))


def two_server_topology() -> Topology:
    """Pairs of servers as 16-GPU "nodes", for one 16-way tensor group per pair. A ring
    all-reduce over the 16 ranks crosses from one server to the other once per direction: of
    its 2(n-1)/n x S per link, the NIC carries one link's share, like every NVLink hop, so the
    ring runs at the NIC's full 25 Gbit/s (not an eighth of it: the 8 GPUs of a server do not
    each send over the NIC) and each of its 2(n-1) steps waits for the slowest hop, the NIC's
    latency. The pair has two NICs for the data-parallel all-reduces that leave it (the flows
    its 16 groups send share them: placement.py)."""
    h = HARDWARE
    return Topology(**dict(h, num_nodes=h["num_nodes"] // 2, gpus_per_node=2 * h["gpus_per_node"],
                           intra_node_bandwidth_gbps=h["nic_bandwidth_gbps"],
                           intra_node_latency_us=Topology().inter_node_latency_us,
                           nics_per_node=2 * h["nics_per_node"]))


class _Sequential:
    """An estimate of inter-layer model parallelism without pipelining: the m microbatches go
    through the d stages one at a time (a stage works only while the microbatch is on it)."""

    def __init__(self, plan):
        d, m = plan.layout.pipeline, plan.layout.num_microbatches
        one = sum(plan.fwd[s] + plan.bwd[s] for s in range(d)) + 2 * sum(plan.p2p)
        self.layout, self.plan = plan.layout, plan
        self.time_per_batch = m * one + max(plan.norm[s] + plan.step[s] for s in range(d))
        self.samples_per_s = plan.layout.global_batch / self.time_per_batch


def no_pipelining(model_name: str, batch: int, nodes: int = 8, recompute=(False, True),
                  **kw):
    """The fastest sequential layout (d > 1) whose flush memory fits (an upper bound of its own:
    one microbatch in flight needs no more than 1F1B's min(d - s, m))."""
    key = ("sequential", model_name, batch, nodes, recompute, json.dumps(kw, sort_keys=True))
    if key not in _CACHE:
        model, topo = paper_model(model_name), _topology(nodes)
        setup = Setup(model, "fp16", grad_reduce_bytes=GRAD_REDUCE_BYTES, flash=FLASH,
                      grad_accumulation=GRAD_ACCUMULATION)
        times = LayerTimes(setup, PROFILE, topo)
        plans = (stage_plan(setup, layout, times, topo) for layout in enumerate_layouts(
            model, topo, batch, ("flush",), recompute, (1,), distributed_optimizer=(False,),
            sequence_parallel=(False,), **kw) if layout.pipeline > 1)
        fits = [_Sequential(p) for p in plans if p.max_memory <= topo.usable_memory_gb * GB]
        _CACHE[key] = max(fits, key=lambda e: e.samples_per_s, default=None)
    return _CACHE[key]


def _topology(nodes: int) -> Topology:
    return Topology(**dict(HARDWARE, num_nodes=nodes))


def up_to(pairs, baseline=("gpipe",)):
    vals = [(r, what) for r, what in pairs if r is not None]
    return max(vals) if vals else (None, f"{baseline[0]} does not fit: {_WHY.get(baseline)}")


def set_nic(gbps: float) -> None:
    """Every row from here on with the servers' NICs moving `gbps` Gbit/s (the paper's p3.16xlarge:
    25 at line rate; what NCCL's TCP transport reached on them is not measured anywhere found:
    bench/README.md, session 35)."""
    HARDWARE.update(nic_bandwidth_gbps=gbps, inter_node_bandwidth_gbps=gbps)
    _CACHE.clear()
    _WHY.clear()


def set_usable(gib: float) -> None:
    """Every row from here on at `gib` usable GiB per GPU (the cache cleared)."""
    HARDWARE["memory_reserve_fraction"] = reserve_at(gib)
    _CACHE.clear()
    _WHY.clear()
