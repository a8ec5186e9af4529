"""Search over layouts: every (t, d, w) with t*d*w = N (t inside a node), every micro batch b that
divides the per-replica batch, recomputation (none, selective, full), the distributed optimizer on
and off (w > 1), sequence parallelism on and off (t > 1), each schedule the number of microbatches
suits (`ScheduleKind.accepts`: 2BW needs m >= d) and, on more than one node, both rank orders; the
`*_sizes`/`micro_batches`/`num_microbatches` and option filters keep only what the caller fixed.
Layouts over the usable memory are dropped; the rest are ranked by predicted time per batch (the
global batch is fixed, so this is ranking by samples/s): a memory saving is chosen when it makes a
layout fit that is faster than every layout without it, or when it costs no time.

Semantics before a sliver of speed: predictions within `TIE` of each other are a tie, and a tie
goes to the synchronous schedule (`ScheduleKind.synchronous`: exact gradients), then to the smaller
memory footprint. An asynchronous schedule on one pipeline stage is not offered when a synchronous
one is allowed: with nothing to fill, 2BW's second version only adds staleness (its sole gain
there, hiding the gradient all-reduce behind the next forwards, is not worth a stale gradient).

Every layout gets a compute floor (`cost_model.compute_floor`, from its compute alone) and is
planned (partition, memory, `lower_bound()`) only when the floors reach it; planned layouts that
fit are simulated in increasing bound order, and the search stops once the k-th best prediction
beats every remaining bound and floor (branch and bound). Floor <= bound <= prediction, so the
result equals exhaustive simulation (`exhaustive=True` plans and simulates everything; the
tests compare both), and most layouts are never planned.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field, replace

from megatron_2bw.config import RANK_ORDERS, ModelConfig
from megatron_2bw.config import num_microbatches as config_microbatches
from megatron_2bw.models.flops import DTYPE_BYTES
from megatron_2bw.planner.cost_model import (OPTIMIZER_COPIES, LayerTimes, Layout, Setup,
                                             compute_floor, stage_plan)
from megatron_2bw.planner.memory import largest_affine_fit, layout_stage_memory
from megatron_2bw.planner.simulate import Estimate, predict
from megatron_2bw.planner.topology import GB, PlanError, Topology
from megatron_2bw.schedule.compensation_methods import NONE as NO_COMPENSATION
from megatron_2bw.schedule.kinds import FIRST_STAGE, schedule_kind, schedule_names

SCHEDULES = schedule_names()
TIE = 1e-5  # relative difference of two predictions that counts as a tie
RECOMPUTE = (False, "selective", True)  # none, selective (core attention), full


@dataclass
class SearchResult:
    ranked: list                     # best first (Estimates)
    considered: int                  # layouts enumerated
    fitting: int                     # of the examined, those that fit in memory
    simulated: int                   # of which were simulated
    smallest_footprint_gb: float
    seconds: float
    topology: Topology = field(repr=False, default=None)
    best_by: dict = field(default_factory=dict)       # group(layout) -> best Estimate
    smallest_by: dict = field(default_factory=dict)   # group(layout) -> smallest footprint, GB
    examined: int = 0                # layouts planned (memory, bound): the rest were beaten by
    #                                  the best on their compute floor alone

    @property
    def best(self) -> Estimate:
        return self.ranked[0]


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _key(est: Estimate) -> tuple:
    """Rank: time (ties within TIE), then the synchronous schedule, then memory."""
    tied = float(f"{est.time_per_batch:.6g}")  # quantum <= TIE
    return (tied, not est.layout.kind.synchronous, est.plan.max_memory, est.layout.describe())


def _check_inputs(model: ModelConfig, global_batch, schedules, dtype, optimizer, recompute):
    if not isinstance(global_batch, int) or isinstance(global_batch, bool) or global_batch < 1:
        raise PlanError(f"--global-batch-size must be an integer >= 1, got {global_batch!r}")
    bad = [s for s in schedules if s not in SCHEDULES]
    if bad or not schedules:
        raise PlanError(f"unknown schedule {bad[0] if bad else '(none)'!r} in --schedules: use a "
                        f"comma-separated subset of {','.join(SCHEDULES)}")
    if dtype not in DTYPE_BYTES:
        raise PlanError(f"unknown precision {dtype!r}: use one of {', '.join(DTYPE_BYTES)}")
    if optimizer not in OPTIMIZER_COPIES:
        raise PlanError(f"unknown optimizer {optimizer!r}: use one of "
                        f"{', '.join(OPTIMIZER_COPIES)}")
    if not recompute or any(rc not in RECOMPUTE for rc in recompute):
        raise PlanError(f"recompute options {recompute!r}: give a non-empty subset of off "
                        "(False), selective and full (True)")
    for name, value in (("--num-layers", model.num_layers), ("--hidden-size", model.hidden_size),
                        ("--num-attention-heads", model.num_attention_heads),
                        ("--seq-length", model.seq_length), ("--vocab-size", model.vocab_size)):
        if not isinstance(value, int) or value < 1:
            raise PlanError(f"{name} must be an integer >= 1, got {value!r}")
    if model.hidden_size % model.num_attention_heads:
        raise PlanError(f"--hidden-size {model.hidden_size} is not divisible by "
                        f"--num-attention-heads {model.num_attention_heads}")


def enumerate_layouts(model: ModelConfig, topology: Topology, global_batch: int,
                      schedules=SCHEDULES, recompute=RECOMPUTE, tensor_sizes=None,
                      micro_batches=None, rank_orders=RANK_ORDERS, pipeline_sizes=None,
                      data_sizes=None, num_microbatches=None, distributed_optimizer=(False, True),
                      sequence_parallel=(False, True), accept=None):
    """Yield every candidate Layout (memory is checked later). A filter that is None allows
    every value; the distributed optimizer is tried only with w > 1, sequence parallelism only
    with t > 1 dividing the sequence; `accept(layout)`, when given, must say yes (--auto-plan:
    a batch-size ramp's smallest batch, planner/auto.py)."""
    n, gpn = topology.num_gpus, topology.gpus_per_node
    orders = tuple(rank_orders) if topology.num_nodes > 1 else tuple(rank_orders)[:1]
    kinds = [schedule_kind(s) for s in schedules]
    any_synchronous = any(k.synchronous for k in kinds)
    for t in divisors(gpn):
        if (model.num_attention_heads % t or model.vocab_size % t or model.ffn_size % t or n % t
                or model.query_groups % t or (tensor_sizes and t not in tensor_sizes)):
            continue  # the engine shards heads, key/value groups, the vocabulary and the MLP
        for d in divisors(n // t):
            if d > model.num_layers or (pipeline_sizes and d not in pipeline_sizes):
                continue
            w = n // (t * d)
            if global_batch % w or (data_sizes and w not in data_sizes):
                continue
            for b in divisors(global_batch // w):
                m = config_microbatches(global_batch, b, w)
                if (micro_batches and b not in micro_batches) or \
                        (num_microbatches and m not in num_microbatches):
                    continue
                for kind in kinds:
                    if not kind.accepts(d, m) or (d == 1 and any_synchronous
                                                  and not kind.synchronous):
                        continue
                    if accept is not None and not accept(Layout(kind.name, t, d, w, b, m)):
                        continue
                    for rc, do, sp in _options(recompute, distributed_optimizer,
                                               sequence_parallel, t, w, model.seq_length):
                        for order in (orders if d > 1 and w > 1 else orders[:1]):
                            yield Layout(kind.name, t, d, w, b, m, rc is True, order, do, sp,
                                         rc == "selective")


def _options(recompute, distributed_optimizer, sequence_parallel, t: int, w: int, seq: int):
    """(recompute, distributed optimizer, sequence parallel) choices that mean something here."""
    dist = [x for x in distributed_optimizer if w > 1 or not x] or [False]  # w = 1: a no-op
    seqp = [x for x in sequence_parallel if (t > 1 and seq % t == 0) or not x]  # needs t > 1
    for rc in recompute:
        for do in dict.fromkeys(dist):
            for sp in dict.fromkeys(seqp):
                yield rc, do, sp


def _fewer_buffers(setup, layout, times, topology, two, usable):
    """The layout with fewer fp32 gradient buffers when its two per stage do not fit: first one
    on stage 0 only (--2bw-grad-buffers first: the stage with the most microbatches in flight,
    at about no time), and if that does not fit either, one on every stage (1: each stage waits
    for N(t) before batch t+1's first backward). At an equal layout neither is faster than two
    (tests/unit/test_planner_grad_buffers.py), so they are tried only here and the search's work
    grows only by the layouts that are over memory."""
    for g in [c for c in layout.kind.grad_buffers_choices[1:] if c == FIRST_STAGE] + [1]:
        plan = stage_plan(setup, replace(layout, grad_buffers=g), times, topology)
        plan.two_buffer_memory = two.max_memory
        if plan.max_memory <= usable:
            break
    return plan


def _fewer_in_flight(setup, layout, times, topology, full, usable):
    """A GPipe layout whose m in-flight microbatches do not fit, in flushes of the most
    microbatches that fit (--gpipe-microbatches-per-flush k, as the paper's GPipe runs a global
    batch whose stashes do not fit): time falls with k (fewer pipeline fills), so the largest k
    that fits is the one. k changes no action's duration, and a stage's memory is affine in the
    microbatches it holds: the plan at k is the plan at k = 1 with k - 1 more stashes, each
    (the plan at m - the plan at 1) / (m - 1). The plan at k = 1 when none fits."""
    m = layout.num_microbatches
    one = stage_plan(setup, replace(layout, microbatches_per_flush=1), times, topology)
    stash = [(high["total"] - low["total"]) / (m - 1)
             for low, high in zip(one.memory, full.memory)]
    k = largest_affine_fit([low["total"] for low in one.memory], stash, usable, m - 1)
    plan = one
    if k > 1:
        split = replace(layout, microbatches_per_flush=k)
        plan = replace(
            one, layout=split, peak_in_flight=[split.kind.in_flight(split.pipeline, m, s)
                                               for s in range(split.pipeline)],
            memory=[dict(low, activations=low["activations"] + (k - 1) * per,
                         total=low["total"] + (k - 1) * per)
                    for low, per in zip(one.memory, stash)])
    plan.all_in_flight_memory = full.max_memory
    return plan


def _any_partition_bound(plan, times) -> float:
    """A time per batch no partition of the plan's layout beats: m x its slowest stage's compute
    (the time-balanced partition has the least), and each stage's blocking receives (the same
    on any partition) plus m x the least compute a stage can have (its cheapest layer)."""
    L, m = plan.layout, plan.layout.num_microbatches
    key = ("least", L.micro_batch, L.tensor, L.sequence_parallel)
    if key not in times._cache:
        times._cache[key] = min(map(sum, zip(*times.get(*key[1:])[1:])))
    # each stage's comm_floor is m x its slower link: their largest, m x the slowest link
    return m * max(max(map(sum, zip(plan.fwd, plan.bwd))),
                   max(plan.p2p, default=0.0) + times._cache[key])


def _fitting_partition(setup, layout, times, topology, balanced, usable):
    """A layout whose time-balanced partition does not fit, on the fastest partition whose every
    stage fits (`LayerTimes.partition(fits=)`: fewer layers on the stages that hold the most,
    the embedding's, the head's, those with more microbatches in flight); unchanged when none
    does. Tried only for layouts over memory whose stages' state (weights, gradients,
    optimizer: about the same total on any partition) averages within it."""
    L, d = layout, layout.pipeline
    if sum(m["total"] - m["activations"] for m in balanced.memory) > d * usable:
        return balanced
    # memory depends on neither the rank order, the links nor m beyond the microbatches each
    # stage holds: one answer for layouts that differ only there
    kind = L.kind
    key = ("fit", L.micro_batch, L.tensor, L.sequence_parallel, L.schedule, L.grad_buffers,
           L.microbatches_per_flush, tuple(kind.in_flight(d, L.num_microbatches, s)
                                           for s in range(d)),
           L.recompute, L.selective, L.shards, usable)
    if key not in times._cache:
        memory_of = layout_stage_memory(setup, L, times)
        n = len(times.get(L.micro_batch, L.tensor, L.sequence_parallel)[0])
        # about the least any split holds in all: one layer on each stage but the last, which
        # holds the rest (later stages hold fewer microbatches); another split may keep one
        # layer's working memory less (a stage without a transformer layer), and one buffer on
        # the first stage holds less state there: over (d + 1) x usable, none fits
        if kind.grad_buffers_of(0) == kind.grad_buffers_of(d - 1) and sum(
                memory_of(s, s, s + 1 if s < d - 1 else n)[0]["total"]
                for s in range(d)) > (d + 1) * usable:
            times._cache[key] = None
    if key not in times._cache:
        times._cache[key] = times.partition(
            L.micro_batch, L.tensor, d, L.recompute, L.selective, L.sequence_parallel,
            fits=lambda s, lo, hi: memory_of(s, lo, hi)[0]["total"] <= usable)
    bounds = times._cache[key]
    if bounds is None:
        return balanced
    plan = stage_plan(setup, L, times, topology, bounds=bounds)
    plan.balanced_memory = balanced.max_memory
    plan.two_buffer_memory = balanced.two_buffer_memory
    plan.all_in_flight_memory = balanced.all_in_flight_memory
    return plan


def search(model: ModelConfig, topology: Topology, profile, global_batch: int,
           schedules=SCHEDULES, dtype: str = "fp32", optimizer: str = "adam",
           recompute=RECOMPUTE, tensor_sizes=None, micro_batches=None,
           rank_orders=RANK_ORDERS, top_k: int = 5, exhaustive: bool = False,
           arch: str = "gpt", pipeline_sizes=None, data_sizes=None,
           num_microbatches=None, distributed_optimizer=(False, True),
           sequence_parallel=(False, True), compensation: str = NO_COMPENSATION,
           group=None, grad_reduce_bytes: float = 4.0,
           one_buffer: bool = True, grad_accumulation: str = "fp32",
           overlap_grad_reduce: bool = True, bucket: int | None = None,
           gpipe_flushes: bool = True, fit_only: bool = False,
           flash: bool = True, fit_partition: bool = True, accept=None) -> SearchResult:
    """`grad_reduce_bytes`: Setup's (4, the engine's fp32 gradient all-reduce). `one_buffer`:
    try a 2BW layout whose two gradient buffers do not fit with fewer (`_fewer_buffers`; False:
    two only). `gpipe_flushes`: run a GPipe layout whose m stashes do not fit in flushes of
    fewer microbatches (`_fewer_in_flight`; False: one flush of all m).
    `grad_accumulation`: --grad-accumulation (Setup's, the memory of bf16/fp16 gradients).
    `overlap_grad_reduce`, `bucket`: Setup's (--no-overlap-grad-reduce, --ddp-bucket-size).
    `group(layout) -> key`, when given, also finds the best layout of every group (in
    `best_by`, as a search restricted to that group would; `smallest_by` for the footprints)
    within the same branch and bound: no second search. `fit_only`: whether anything fits,
    fast: the first layout (by compute floor) that fits, unsimulated, timed by its lower bound
    (source "bound"); a PlanError as always when none does. `flash`: Setup's (False: attention
    keeps its s x s scores, as before FlashAttention: bench/paper_table.py's 2020 stack).
    `fit_partition`: plan a layout whose time-balanced partition does not fit on the fastest
    partition that does (`_fitting_partition`; False: the time-balanced one only). `accept`:
    `enumerate_layouts`'."""
    start = time.perf_counter()
    topology.validate()
    _check_inputs(model, global_batch, schedules, dtype, optimizer, recompute)
    profile.check_model(model, dtype)
    setup = Setup(model, dtype, optimizer, arch, compensation=compensation,
                  grad_reduce_bytes=grad_reduce_bytes, grad_accumulation=grad_accumulation,
                  overlap_grad_reduce=overlap_grad_reduce, bucket=bucket, flash=flash)
    times = LayerTimes(setup, profile, topology)
    usable = topology.usable_memory_gb * GB
    layouts = list(enumerate_layouts(model, topology, global_batch, schedules, recompute,
                                     tensor_sizes, micro_batches, rank_orders, pipeline_sizes,
                                     data_sizes, num_microbatches, distributed_optimizer,
                                     sequence_parallel, accept))
    if not layouts:
        raise PlanError(f"no valid layout for {topology.num_gpus} GPUs, global batch "
                        f"{global_batch} "
                        f"and schedules {','.join(schedules)}: the global batch must be a multiple "
                        "of micro batch x data-parallel size (and some schedules need a minimum "
                        "number of microbatches: 2bw as many as stages); try a multiple of the "
                        "GPU count")
    # layouts are planned lazily, in order of their compute floor (<= every bound of theirs)
    floors = sorted((compute_floor(L, times), i) for i, L in enumerate(layouts))
    left: dict = {}  # group -> layouts not yet planned, or planned, fitting and not simulated
    for L in layouts:
        g = group(L) if group else None
        left[g] = left.get(g, 0) + 1
    examined, smallest, heap, smallest_by, fitting = 0, float("inf"), [], {}, 0
    ranked, simulated, best_by = [], 0, {}

    def done(bound: float) -> bool:
        if exhaustive or len(ranked) < top_k \
                or bound <= ranked[top_k - 1].time_per_batch * (1 + 2 * TIE):
            return False
        return all(g in best_by and bound > best_by[g].time_per_batch * (1 + 2 * TIE)
                   for g, n in left.items() if n and group)
    finished = False
    for floor, i in floors + [(float("inf"), -1)]:
        while heap and heap[0][0] <= floor:  # simulate in bound order up to the next floor
            bound, j, plan, over = heapq.heappop(heap)
            if done(bound):
                finished = True
                break
            g = group(plan.layout) if group else None
            if over:  # over memory on its time-balanced partition: now on one that fits
                plan = _fitting_partition(setup, plan.layout, times, topology, plan, usable)
                smallest = min(smallest, plan.max_memory)
                if group:
                    smallest_by[g] = min(smallest_by[g], plan.max_memory / GB)
                if plan.max_memory <= usable:
                    fitting += 1
                    heapq.heappush(heap, (plan.lower_bound(), j, plan, False))
                else:
                    left[g] -= 1
                continue
            est = predict(plan)
            ranked.append(est)
            simulated += 1
            ranked.sort(key=_key)
            left[g] -= 1
            if g not in best_by or _key(est) < _key(best_by[g]):
                best_by[g] = est
        if finished or i < 0 or done(floor):  # nothing left can beat what is ranked
            break
        layout = layouts[i]
        examined += 1
        plan = stage_plan(setup, layout, times, topology)
        if one_buffer and plan.max_memory > usable and 1 in layout.kind.grad_buffers_choices[1:]:
            plan = _fewer_buffers(setup, layout, times, topology, plan, usable)
        if gpipe_flushes and plan.max_memory > usable and layout.kind.splits_into_flushes \
                and layout.num_microbatches > 1:
            plan = _fewer_in_flight(setup, layout, times, topology, plan, usable)
        refit = fit_partition and plan.max_memory > usable and layout.pipeline > 1
        if refit and fit_only:
            plan, refit = _fitting_partition(setup, plan.layout, times, topology, plan, usable), \
                False
        smallest = min(smallest, plan.max_memory)
        g = group(layout) if group else None
        if group:
            smallest_by[g] = min(smallest_by.get(g, float("inf")), plan.max_memory / GB)
        if plan.max_memory <= usable:
            fitting += 1
            if fit_only:
                bound = plan.lower_bound()
                ranked = [Estimate(plan, bound, bound, "bound")]
                break
            heapq.heappush(heap, (plan.lower_bound(), i, plan, False))
        elif refit:  # partitioned to fit when a bound of every partition's time is reached
            heapq.heappush(heap, (_any_partition_bound(plan, times), i, plan, True))
        else:
            left[g] -= 1
    if not ranked:
        raise PlanError(f"does not fit: smallest footprint {smallest / GB:.2f} GB > "
                        f"{topology.usable_memory_gb:.2f} GB usable per GPU (of "
                        f"{topology.gpu_memory_gb:g} GB): add GPUs or memory, use bf16, "
                        "recomputation, the distributed optimizer or a smaller model")
    if not exhaustive:
        ranked = ranked[:top_k]
    return SearchResult(ranked, len(layouts), fitting, simulated, smallest / GB,
                        time.perf_counter() - start, topology, best_by, smallest_by, examined)


__all__ = ["SCHEDULES", "RECOMPUTE", "SearchResult", "search", "enumerate_layouts", "divisors"]
