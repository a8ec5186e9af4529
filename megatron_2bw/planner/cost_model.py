"""Cost model of one layout: per-stage durations for the simulator, memory per stage, a lower bound.

A `Layout` is (schedule, t, d, w, b, m, recompute, rank order, distributed optimizer, sequence
parallelism, selective recomputation). `stage_plan(setup, layout, ...)` turns it into a
`StagePlan`:

- compute: F_s, B_s = sums of the per-layer profile times of the stage's layers (a contiguous
  range from `partition.py`); the first and the last stage's forward also read the microbatch
  (inputs, labels: `profile.data_time`; the partitioner counts it too); recomputation adds the
  transformer layers' forward to B_s (the engine, like Megatron, recomputes transformer layers
  only); tensor parallelism adds, over the node-local link, two all-reduces of the activation per
  transformer layer and pass, one for the vocab-parallel embedding (forward) and the output
  layer's input gradient, and the cross-entropy's three small ones.
- p2p: an activation (or its gradient) of b*s*h elements in the model dtype crosses the link the
  placement implies between stage c and c+1 (inter-node if any replica's pair sits on two nodes).
- R/N/S: the data-parallel all-reduce (ring over the slowest link of the group) starts in buckets
  during the stage's last backward of the batch (`reductions._after_last_backward`: what that
  backward cannot hide; pipeline/grad_reduce.py), R launches the rest and the tied embedding
  gradient's (over the 2w-rank tied group); N waits for them, so N costs what is left after the
  compute between R and N (the kind's `forwards_between_reduce_and_norm`: one forward in 2BW,
  nothing in flush/gpipe); S is the local step work (`profile.step_time`) plus the latency of the
  small model-parallel all-reduce, plus, in 2BW with --2bw-compensation, the method's work beyond
  the step (`profile.compensation_time`: measured by `measure_profile(compensation=)`, else from
  its extra bytes per parameter, `profile.compensation_bytes`).
  With the distributed optimizer R starts a reduce-scatter (half a ring all-reduce), S steps 1/w
  of the stage and all-gathers the new weights (the other half), counted in full in S: the engine
  overlaps it only with what precedes the next forward (a conservative price), and the [norm^2,
  loss, flags] all-reduce spans the world.
- selective recomputation repeats each transformer layer's core attention (its share of the
  layer's forward FLOPs) in the backward and frees what the attention kernel keeps beyond q, k, v;
  sequence parallelism divides the norm, dropout and residual activations and the stage-to-stage
  messages by t (models/flops.py); its all-gathers and reduce-scatters move what the all-reduces
  moved: they are priced at the full b*s*h activation, not at the 1/t chunk a stage sends.
- memory: exactly the engine's buffers (`pipeline/weights.py`, `optim/optimizer.py`): weight
  versions (the kind's `num_slots`: 2 in 2BW) in the model dtype, fp32 master (bf16/fp16, and
  fp32 with a 2BW compensation whose slots hold predictions: `compensation.keeps_master`), fp32
  gradient buffer per version slot (+ the loss and control flags), the low-precision gradient
  buffer (bf16/fp16), optimizer state (Adam 2, SGD 1 fp32 copies; one more, the kept gradient,
  with a compensation that keeps it: `Method.keeps_grad`); with the distributed optimizer
  every buffer is padded to a multiple of w (`optim/shard_layout.py`) and master weights and
  optimizer state hold 1/w of it; plus stashed activations per in-flight microbatch (the kind's
  `in_flight`: 2BW and flush min(d - s, m) on stage s, GPipe m (k in flushes of k microbatches:
  --gpipe-microbatches-per-flush), whose last stage so keeps each microbatch's loss state, one
  fp32 copy of its logits, and the fp32 logits beside it for the microbatch being computed:
  `stage_memory`); full recomputation stashes only each transformer layer's input and needs one
  layer's full activations while recomputing. The data-parallel all-reduce moves
  `Setup.grad_reduce_bytes` per gradient element (the engine's fp32: 4). Partitions are
  time-balanced unless the search asks for one that fits (`LayerTimes.partition(fits=)`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from megatron_2bw.config import ModelConfig
from megatron_2bw.models.flops import DTYPE_BYTES, layer_costs
from megatron_2bw.models.partition import partition, partition_within
from megatron_2bw.planner.memory import (OPTIMIZER_COPIES, _kept, _recomputed,  # noqa: F401
                                         activation_bytes, layout_stage_memory, stage_memory,
                                         stage_params, stage_tied, state_bytes)
from megatron_2bw.planner.placement import placement
from megatron_2bw.planner.reductions import _reduction
from megatron_2bw.schedule.compensation_methods import NONE as NO_COMPENSATION
from megatron_2bw.schedule.kinds import ScheduleKind, schedule_kind_of


@dataclass(frozen=True)
class Layout:
    schedule: str
    tensor: int
    pipeline: int
    data: int
    micro_batch: int
    num_microbatches: int
    recompute: bool = False      # full recomputation of transformer layers
    rank_order: str = "tp-dp-pp"
    distributed_optimizer: bool = False
    sequence_parallel: bool = False
    selective: bool = False      # selective recomputation (core attention)
    grad_buffers: int | None = None  # --2bw-grad-buffers (None: the kind's own, one per slot)
    microbatches_per_flush: int | None = None  # --gpipe-microbatches-per-flush (None: all m)

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.num_microbatches * self.data

    @property
    def num_gpus(self) -> int:
        return self.tensor * self.pipeline * self.data

    @property
    def kind(self) -> ScheduleKind:
        return schedule_kind_of(self.schedule, self.grad_buffers, self.microbatches_per_flush)

    @property
    def recompute_name(self) -> str:
        return "full" if self.recompute else ("sel" if self.selective else "no")

    @property
    def shards(self) -> int:
        """Ways the master weights and optimizer state are split (w with the distributed
        optimizer, else 1)."""
        return self.data if self.distributed_optimizer else 1

    def describe(self) -> str:
        return (f"{self.schedule} t{self.tensor} d{self.pipeline} w{self.data} b{self.micro_batch} "
                f"m{self.num_microbatches}{' rc' if self.recompute else ''}"
                f"{' sel' if self.selective else ''}{' do' if self.distributed_optimizer else ''}"
                f"{' sp' if self.sequence_parallel else ''}"
                f"{f' g{self.grad_buffers}' if self.grad_buffers else ''}"
                f"{f' f{self.microbatches_per_flush}' if self.microbatches_per_flush else ''}"
                f" {self.rank_order}")


@dataclass(frozen=True)
class Setup:
    """What stays fixed across candidates."""
    model: ModelConfig
    dtype: str = "fp32"
    optimizer: str = "adam"
    arch: str = "gpt"
    flash: bool = True
    compensation: str = NO_COMPENSATION  # --2bw-compensation (memory: `state_bytes`)
    # bytes per gradient element the data-parallel all-reduce moves: the engine reduces its fp32
    # buffers (4); Megatron-LM of 2020, which the PipeDream-2BW paper ran, reduced the fp16
    # gradients unless --fp32-allreduce (2: bench/paper_table.py)
    grad_reduce_bytes: float = 4.0
    grad_accumulation: str = "fp32"  # --grad-accumulation (memory: `state_bytes`)
    # the data-parallel reduction (pipeline/grad_reduce.py): buckets start in the stage's last
    # backward of the batch (--no-overlap-grad-reduce: False), of --ddp-bucket-size elements
    overlap_grad_reduce: bool = True
    bucket: int | None = None


# ---- the plan of one layout ------------------------------------------------------------------


@dataclass
class StagePlan:
    layout: Layout
    bounds: list                 # spec-index boundaries per stage
    fwd: list                    # per stage, one microbatch
    bwd: list                    # per stage, one microbatch (recompute included)
    p2p: list                    # per boundary c (stage c <-> c+1): one activation or gradient
    reduce: list                 # per stage: R duration
    norm: list                   # per stage: N duration (exposed all-reduce)
    step: list                   # per stage: S duration
    allreduce: list              # per stage: full gradient all-reduce time (before overlap)
    memory: list                 # per stage: dict of byte counts, "total" included
    peak_in_flight: list
    inter_node_p2p: list = field(default_factory=list)
    # a one-buffer 2BW the search fell back to: the largest stage total with today's two
    # buffers (which did not fit), for the plan line's reason; 0.0 otherwise
    two_buffer_memory: float = 0.0
    all_in_flight_memory: float = 0.0  # GPipe in flushes: its footprint with all m in flight
    balanced_memory: float = 0.0  # partitioned to fit (search.py): the time-balanced footprint

    @cached_property
    def max_memory(self) -> float:  # (`memory` is never changed in place: replace() copies)
        return max(m["total"] for m in self.memory)

    def busy(self, stage: int) -> float:
        m = self.layout.num_microbatches
        return (m * (self.fwd[stage] + self.bwd[stage]) + self.reduce[stage] + self.norm[stage]
                + self.step[stage])

    def comm_floor(self, stage: int) -> float:
        """Time the stage is blocked in p2p per batch at least: each of its m microbatches needs
        an activation received (stage > 0) and a gradient (stage < d - 1), a comm group holds at
        most one of each and blocks the stage for its slowest op, so >= m x the slower link."""
        d, s = self.layout.pipeline, stage
        links = ([self.p2p[s - 1]] if s > 0 else []) + ([self.p2p[s]] if s < d - 1 else [])
        return self.layout.num_microbatches * max(links, default=0.0)

    def lower_bound(self) -> float:
        """A time per batch no schedule run can beat (the prediction is never below it)."""
        d, m = self.layout.pipeline, self.layout.num_microbatches
        bound = max(self.busy(s) + self.comm_floor(s) for s in range(d))
        if not self.layout.kind.flushes:
            return bound
        # flush/gpipe: the batch drains, so the first microbatch's round trip counts, once per
        # flush (GPipe in flushes of k: m // k of k and one of the rest, one after another)
        chains, chain = [], 0.0
        for s in range(d):
            chains.append(chain)
            chain += self.fwd[s] + self.bwd[s] + (2 * self.p2p[s] if s < d - 1 else 0.0)
        k = self.layout.kind.microbatches_per_flush or m
        flushes = [(n, x) for n, x in ((m // k, k), (1 if m % k else 0, m % k)) if n]
        tail = self.reduce[0] + self.norm[0] + self.step[0]
        return max(bound, tail + sum(n * max(chains[s] + x * (self.fwd[s] + self.bwd[s])
                                             for s in range(d)) for n, x in flushes))

    def durations(self):
        """(durations callable, comm callable) for `pipeline.simulate.simulate`."""
        table = [{"F": self.fwd[s], "B": self.bwd[s], "R": self.reduce[s], "N": self.norm[s],
                  "S": self.step[s]} for s in range(self.layout.pipeline)]
        p2p = self.p2p

        def dur(stage, a):
            return table[stage][a.kind]

        def comm(stage, a):
            return p2p[stage - 1] if a.kind in ("ra", "sg") else p2p[stage]
        return dur, comm


class LayerTimes:
    """Per-layer (costs, forward, backward) for one (micro batch, tensor size), cached."""

    def __init__(self, setup: Setup, profile, topology):
        self.setup, self.profile, self.topo = setup, profile, topology
        self._cache = {}

    def get(self, b: int, t: int, sp: bool = False) -> tuple:
        key = (b, t, sp)
        if key not in self._cache:
            s = self.setup
            costs = layer_costs(s.model, b, t, s.dtype, s.arch, s.flash, sequence_parallel=sp)
            rows = b * s.model.seq_length  # the GEMMs' M (the efficiency curve's matrix size)
            times = [self.profile.layer_times(c, b, t, tokens=rows) for c in costs]
            tp = [(0.0, 0.0)] * len(costs)
            if t > 1:  # tensor-parallel all-reduces (node-local): (forward, backward) per layer
                # the full activation: sequence parallelism's all-gather + reduce-scatter move
                # what the all-reduce moved, though a stage boundary then sends 1/t of it
                full = costs[1].output_bytes * (t if sp else 1)
                one = self.topo.ring_time(full, t, False)
                ce = 3 * self.topo.ring_time(4.0 * b * s.model.seq_length, t, False)
                per = {"embedding": (one, 0.0), "transformer": (2 * one, 2 * one),
                       "head": (ce, one)}  # vocab-parallel lookup; cross entropy; input grad
                tp = [per[c.name] for c in costs]
            self._cache[key] = (costs, [f + x for (f, _), (x, _) in zip(times, tp)],
                                [g + y for (_, g), (_, y) in zip(times, tp)])
        return self._cache[key]

    def prefix(self, b: int, t: int, sp: bool = False) -> dict:
        """Prefix sums over the spec list (O(1) range sums per stage)."""
        key = ("prefix", b, t, sp)
        if key not in self._cache:
            costs, fwd, bwd = self.get(b, t, sp)
            cols = {"fwd": fwd, "bwd": bwd, "params": [c.params for c in costs],
                    "act": [c.act_bytes for c in costs],
                    "keep_rc": [_kept(c, True) for c in costs],
                    "keep_sel": [_kept(c, False, True) for c in costs],
                    "rc_fwd": [f if _recomputed(c) else 0.0 for c, f in zip(costs, fwd)],
                    "sel_fwd": [_selective_time(c, f) for c, f in zip(costs, fwd)]}
            cols["n_rc"] = [1 if _recomputed(c) else 0 for c in costs]
            out = {}
            layers = {(c.act_bytes, c.core_attention_bytes) for c in costs if _recomputed(c)}
            if len(layers) == 1:  # one transformer spec: the working bytes of any range
                a, core = layers.pop()
                out["rc_max"] = {"act_bytes": a, "core_attention_bytes": core}
            for name, col in cols.items():
                acc = [0]
                for x in col:
                    acc.append(acc[-1] + x)
                out[name] = acc
            self._cache[key] = out
        return self._cache[key]

    def placement(self, layout: Layout) -> tuple:
        key = ("place", layout.tensor, layout.pipeline, layout.data, layout.rank_order)
        if key not in self._cache:
            self._cache[key] = placement(layout, self.topo)
        return self._cache[key]

    def partition(self, b: int, t: int, d: int, recompute: bool, selective: bool = False,
                  sp: bool = False, fits=None) -> list | None:
        """The time-balanced stage bounds; with `fits(s, lo, hi)`, the fastest whose stages all
        fit (`partition_within`; None: none does)."""
        key = ("part", b, t, d, recompute, selective, sp)
        if key not in self._cache or fits:
            costs, fwd, bwd = self.get(b, t, sp)
            weights = [f + g + (f if recompute and _recomputed(c) else 0.0)
                       + (_selective_time(c, f) if selective else 0.0)
                       for c, f, g in zip(costs, fwd, bwd)]
            data = self.profile.data_time(b)  # read by the stages holding the first/last layer
            weights[0] += data
            weights[-1] += data
            if fits:
                return partition_within(weights, d, fits)
            self._cache[key] = partition(weights, d)
        return self._cache[key]


def _selective_time(cost, fwd: float) -> float:
    """The forward time of a layer's core attention (what selective recomputation repeats)."""
    if not _recomputed(cost) or not cost.fwd_flops:
        return 0.0
    return fwd * cost.core_attention_flops / cost.fwd_flops


def compute_floor(layout: Layout, times: LayerTimes) -> float:
    """A time per batch below `stage_plan(...).lower_bound()` of the layout and of each of its
    variants (fewer gradient buffers, GPipe in flushes), from its compute alone, before any
    partition, memory or link is priced: the busiest stage does at least the average stage's
    m (F + B), recomputation included (the search plans layouts in this order)."""
    L = layout
    P = times.prefix(L.micro_batch, L.tensor, L.sequence_parallel)
    cols = ["fwd", "bwd"] + (["rc_fwd"] if L.recompute else []) + \
        (["sel_fwd"] if L.selective else [])
    return L.num_microbatches * sum(P[c][-1] - P[c][0] for c in cols) / L.pipeline


def _stage_compute(costs, P, bounds, L, data) -> list:
    """[(F_s, B_s with recomputation, parameters, tied parameters)] of every stage."""
    d, out = len(bounds) - 1, []
    for s in range(d):
        lo, hi = bounds[s], bounds[s + 1]
        f = P["fwd"][hi] - P["fwd"][lo] + (data if s in (0, d - 1) else 0.0)
        rc = P["rc_fwd"][hi] - P["rc_fwd"][lo] if L.recompute else 0.0
        rc += P["sel_fwd"][hi] - P["sel_fwd"][lo] if L.selective else 0.0
        out.append((f, P["bwd"][hi] - P["bwd"][lo] + rc, stage_params(costs, lo, hi, P),
                    stage_tied(costs, lo, hi, d)))
    return out


def stage_plan(setup: Setup, layout: Layout, times: LayerTimes, topology,
               bounds: list | None = None) -> StagePlan:
    """Everything the simulator and the memory check need for one layout."""
    L = layout
    d, b, t, sp = L.pipeline, L.micro_batch, L.tensor, L.sequence_parallel
    costs = times.get(b, t, sp)[0]
    P = times.prefix(b, t, sp)
    if bounds is None:
        bounds = times.partition(b, t, d, L.recompute, L.selective, sp)
    inter, dp_inter, tied_inter, mp_inter, flows = times.placement(L)
    p2p_flows, dp_flows = flows  # concurrent flows sharing a node's NICs (placement.py)
    w, kind, shards = L.data, L.kind, L.shards
    # [norm^2, loss, flags]: over one rank per stage, or the world with the distributed optimizer
    norm_ar = topology.ring_time(8.0, d * shards, mp_inter or (shards > 1 and any(dp_inter)))
    data = times.profile.data_time(b)  # the first and the last stage read each microbatch
    # a 2BW compensation's work beyond the step, once per batch over what the rank steps (the
    # engine does it in the step or, deferred on a CPU, in its waits: priced in full in S)
    compensated = kind.delay == 1 and setup.compensation != NO_COMPENSATION

    def comp(n: int) -> float:
        return times.profile.compensation_time(n, setup.compensation, setup.dtype) \
            if compensated else 0.0
    # memory depends on neither the rank order, the links nor m beyond the microbatches each
    # stage holds: computed once for the layouts that share those
    flight = tuple(kind.in_flight(d, L.num_microbatches, s) for s in range(d))
    mkey = ("mem", b, t, sp, L.schedule, L.grad_buffers, L.microbatches_per_flush, d, flight,
            L.recompute, L.selective, shards, tuple(bounds))
    # the stages' compute, parameters and tied parts depend on neither the schedule, w, the rank
    # order nor the links: computed once for every layout that shares them
    ckey = ("compute", b, t, sp, L.recompute, L.selective, data, tuple(bounds))
    computed = times._cache.get(ckey)
    if computed is None:
        computed = times._cache[ckey] = _stage_compute(costs, P, bounds, L, data)
    cached = times._cache.get(mkey)
    if cached is None:
        memory_of = layout_stage_memory(setup, L, times)
        cached = times._cache[mkey] = [memory_of(s, bounds[s], bounds[s + 1]) for s in range(d)]
    # the gradient reductions depend on neither the schedule nor m: one row per stage for the
    # layouts that share the stages, w, the shards and the data-parallel links
    rkey = ("reduce", ckey, w, shards, tuple(dp_inter), dp_flows, tied_inter, compensated)
    rows = times._cache.get(rkey)
    if rows is None:
        rows = times._cache[rkey] = [
            _reduction(setup, topology, times.profile, params, tied, g, w, shards, dp_inter[s],
                       dp_flows, tied_inter, comp) for s, (_f, g, params, tied) in enumerate(
                           computed)]
    fwd = [c[0] for c in computed]
    bwd = [c[1] for c in computed]
    memory = [c[0] for c in cached]
    peaks = [c[1] for c in cached]
    ahead = kind.forwards_between_reduce_and_norm  # forwards between R and N
    ar = [t_dp + t_tied for t_dp, t_tied, _e, _s, _g, _c in rows]
    norm = [max(0.0, exposed + t_tied - ahead * f)
            for (_t, t_tied, exposed, _s, _g, _c), f in zip(rows, fwd)]
    step = [st + norm_ar + gather + c for _t, _tt, _e, st, gather, c in rows]
    reduce_ = [0.0] * d
    act = DTYPE_BYTES[setup.dtype] * b * setup.model.seq_length * setup.model.hidden_size
    act /= t if sp else 1  # sequence parallel: each tensor rank sends its chunk
    if setup.arch == "bert":
        act += b * setup.model.seq_length  # the padding mask travels with the hidden states
    pkey = ("p2p", act, tuple(inter), p2p_flows)
    p2p = times._cache.get(pkey)
    if p2p is None:
        p2p = times._cache[pkey] = [topology.transfer_time(act, x, p2p_flows) for x in inter]
    return StagePlan(L, list(bounds), fwd, bwd, p2p, reduce_, norm, step, ar, memory, peaks,
                     inter)


__all__ = ["Layout", "Setup", "StagePlan", "LayerTimes", "stage_plan", "compute_floor",
           "state_bytes",
           "activation_bytes", "stage_params", "stage_memory", "stage_tied", "placement"]
