"""`pretrain_gpt.py --auto-plan`: a Config in, a new Config out (`dataclasses.replace`).

    topology, profile = planner_inputs(args, world_size)     # --plan-topology, --plan-profile...
    cfg = plan(cfg, topology, profile, log=print)            # raises PlanError (a ConfigError)

What the user fixed (`Config.fixed`: a typed flag or a DeepSpeed JSON key) stays as it is; the
planner searches the rest: t, d, w, the micro batch b (so m), the rank order, recomputation
(none, selective, full), the distributed optimizer, sequence parallelism, the schedule, and the
stage partition. The global batch must be fixed (it changes what is trained);
the schedule is searched when nobody fixed it, ties going to the synchronous one (`search.py`).
When no layout keeps every fixed setting, the one-line error names them with their sources.
Times come from `--plan-profile FILE` or an analytic profile (`--device-tflops`,
`--device-efficiency`); the machine is `world_size` processes placed as SLURM / the visible
devices say (or `--plan-topology FILE`).
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_2bw.config import RANK_ORDERS, Config
from megatron_2bw.planner.profile import AnalyticProfile, load_profile
from megatron_2bw.planner.search import RECOMPUTE, SCHEDULES, SearchResult, search
from megatron_2bw.planner.simulate import Estimate
from megatron_2bw.planner.topology import GB, PlanError, resolve_topology
from megatron_2bw.schedule.kinds import FIRST_STAGE, schedule_kind

TOPOLOGY_FLAGS = ("gpus_per_node", "gpu_memory_gb", "intra_node_bandwidth_gbps",
                  "inter_node_bandwidth_gbps", "intra_node_latency_us", "inter_node_latency_us")

# the settings the planner chooses, by Config path
PLANNED = ("parallel.tensor", "parallel.pipeline", "parallel.data", "parallel.rank_order",
           "batch.micro_batch_size", "batch.num_microbatches", "schedule",
           "model.recompute_granularity", "parallel.distributed_optimizer",
           "parallel.sequence_parallel")


@dataclass
class Plan:
    estimate: Estimate
    result: SearchResult

    @property
    def layout(self):
        return self.estimate.layout

    @property
    def partition(self) -> list:
        """Spec-index stage boundaries ([embedding, blocks..., head] indexing)."""
        return list(self.estimate.plan.bounds)

    def config(self, cfg: Config) -> Config:
        """`cfg` with this plan's layout; recomputation, the distributed optimizer and sequence
        parallelism (and a one-buffer 2BW's --2bw-grad-buffers) only where the user did not fix
        them."""
        L = self.layout
        new = cfg.replace(
            parallel={"tensor": L.tensor, "pipeline": L.pipeline, "data": L.data,
                      "rank_order": L.rank_order, "partition": tuple(self.partition)},
            batch={"micro_batch_size": L.micro_batch, "global_batch_size": L.global_batch},
            schedule=L.schedule)
        if cfg.source_of("model.recompute_granularity") is None:
            new = new.replace(model={
                "recompute_granularity": "full" if L.recompute else (
                    "selective" if L.selective else None),
                "recompute_method": "uniform" if L.recompute else None,
                "recompute_num_layers": 1 if L.recompute else 0})
        for path, value in (("parallel.distributed_optimizer", L.distributed_optimizer),
                            ("parallel.sequence_parallel", L.sequence_parallel)):
            if cfg.source_of(path) is None:
                new = new.replace(**{path: value})
        if cfg.grad_buffers is None:  # None unless --2bw-grad-buffers was given (kept then)
            new = new.replace(grad_buffers=L.grad_buffers)
        if cfg.microbatches_per_flush is None:  # likewise --gpipe-microbatches-per-flush
            new = new.replace(microbatches_per_flush=L.microbatches_per_flush)
        return new

    def flags(self) -> str:
        return layout_flags(self.layout, self.partition)

    def summary(self) -> str:
        e, topo = self.estimate, self.result.topology
        return (f"auto-plan: {self.flags()} | predicted {e.samples_per_s:.3g} samples/s, "
                f"bubble {e.bubble:.1%}, max memory {max(e.memory_gb):.2f} GB/GPU"
                + "".join(f" | {why}" for why in (grad_buffers_reason(e, topo),
                                                  flushes_reason(e, topo),
                                                  partition_reason(e, topo)) if why))


def layout_flags(L, partition=None) -> str:
    """The pretrain flags of layout L (and of its stage `partition`, when given and d > 1)."""
    flags = (f"--tensor-model-parallel-size {L.tensor} --pipeline-model-parallel-size "
             f"{L.pipeline} --data-parallel-size {L.data} --micro-batch-size {L.micro_batch} "
             f"--global-batch-size {L.global_batch} --pipeline-schedule {L.schedule} "
             f"--rank-order {L.rank_order}")
    if partition is not None and L.pipeline > 1:
        flags += f" --pipeline-partition {','.join(str(b) for b in partition)}"
    if L.recompute:
        flags += (" --recompute-granularity full --recompute-method uniform "
                  "--recompute-num-layers 1")
    elif L.selective:
        flags += " --recompute-activations"
    if L.distributed_optimizer:
        flags += " --use-distributed-optimizer"
    if L.sequence_parallel:
        flags += " --sequence-parallel"
    if L.grad_buffers is not None:
        flags += f" --2bw-grad-buffers {L.grad_buffers}"
    if L.microbatches_per_flush is not None:
        flags += f" --gpipe-microbatches-per-flush {L.microbatches_per_flush}"
    return flags


def grad_buffers_reason(est, topology) -> str:
    """Why the chosen layout runs 2BW on fewer fp32 gradient buffers ('' when it does not): the
    search falls back to them only for a layout whose two buffers do not fit (search.py)."""
    g = est.layout.grad_buffers
    if g not in (1, FIRST_STAGE):
        return ""
    why = (f"two do not fit ({est.plan.two_buffer_memory / GB:.3g} GB > "
           f"{topology.usable_memory_gb:.3g} GB usable per GPU; ")
    if g == FIRST_STAGE:
        return (f"one gradient buffer on the first stage (--2bw-grad-buffers first): {why}"
                f"so needs {est.plan.max_memory / GB:.3g} GB, and the first stage, which posts "
                "the norm's all-reduce last, waits only for its latency before the next batch's "
                "first backward)")
    return (f"one gradient buffer (--2bw-grad-buffers 1): {why}one needs "
            f"{est.plan.max_memory / GB:.3g} GB, and each stage waits for its all-reduce before "
            "the next batch's first backward)")


def partition_reason(est, topology) -> str:
    """Why the chosen layout's stages are not time-balanced ('' when they are): the search
    partitions a layout to fit only when the time-balanced partition does not (search.py)."""
    if not est.plan.balanced_memory:
        return ""
    return (f"stage partition {list(est.plan.bounds)} balances time among the partitions that "
            f"fit: the time-balanced one does not ({est.plan.balanced_memory / GB:.3g} GB > "
            f"{topology.usable_memory_gb:.3g} GB usable per GPU)")


def flushes_reason(est, topology) -> str:
    """Why the chosen GPipe layout runs each batch in flushes of k microbatches ('' when it does
    not): the search splits a GPipe layout only when all m stashes do not fit (search.py)."""
    k, L = est.layout.microbatches_per_flush, est.layout
    if not k:
        return ""
    return (f"gpipe in flushes of {k} microbatch{'es' * (k != 1)} "
            f"(--gpipe-microbatches-per-flush {k}): all "
            f"{L.num_microbatches} in flight do not fit ({est.plan.all_in_flight_memory / GB:.3g}"
            f" GB > {topology.usable_memory_gb:.3g} GB usable per GPU), {k} need "
            f"{est.plan.max_memory / GB:.3g} GB, for {-(-L.num_microbatches // k)} pipeline "
            "fills per batch instead of one")


def planner_inputs(args, world_size: int):
    """(Topology, profile) for `world_size` processes from the --plan-* and device flags."""
    flags = {k: getattr(args, k, None) for k in TOPOLOGY_FLAGS}
    topo = resolve_topology(flags, getattr(args, "plan_topology", None), num_gpus=world_size)
    path = getattr(args, "plan_profile", None)
    if path:
        return topo, load_profile(path)
    return topo, AnalyticProfile(**{k: getattr(args, a) for k, a in
                                    (("device_tflops", "device_tflops"),
                                     ("efficiency", "device_efficiency"))
                                    if getattr(args, a, None) is not None}).validate()


def _only(cfg: Config, path: str):
    """(the fixed value,) when the user fixed `path`, else None (the planner chooses)."""
    if cfg.source_of(path) is None:
        return None
    value = cfg.fixed_value(path)
    return (cfg.get(path) if value is None else value,)


def _ramp_accepts(cfg: Config):
    """With a batch-size ramp: Layout -> whether the ramp's batches suit it (its smallest batch
    the schedule's minimum m, every batch the run reaches a multiple of b x w: the config's
    rules, config/ramp_checks.py); the search sizes the layout for the largest batch. None
    without a ramp."""
    b = cfg.batch
    if not (b.rampup_batch_size or b.step_batch_size_schedule or b.decrease_batch_size_if_needed):
        return None
    from megatron_2bw.config.ramp_checks import ramp_error

    def accept(L) -> bool:
        return ramp_error(cfg.replace(
            parallel={"tensor": L.tensor, "pipeline": L.pipeline, "data": L.data},
            batch={"micro_batch_size": L.micro_batch}, schedule=L.schedule)) is None
    return accept


def search_for(cfg: Config, topology, profile, top_k: int = 1) -> SearchResult:
    """The planner's search restricted to what `cfg` leaves free."""
    if cfg.batch.global_batch_size is None:
        raise PlanError("--auto-plan needs the global batch: give --global-batch-size or "
                        "train_batch_size in the DeepSpeed config (the planner keeps it and "
                        "chooses the micro batch and the parallel sizes)")
    if cfg.source_of("parallel.partition") is not None:
        raise PlanError(f"{cfg.source_of('parallel.partition')} fixes the stage partition, "
                        "which --auto-plan chooses with the layout: drop one of them")
    recompute = _only(cfg, "model.recompute_granularity")
    recompute = RECOMPUTE if recompute is None else \
        ({None: False, "selective": "selective", "full": True}[recompute[0]],)
    try:
        return search(cfg.model, topology, profile, cfg.batch.global_batch_size,
                      schedules=_only(cfg, "schedule") or SCHEDULES,
                      dtype=cfg.precision.dtype, optimizer=cfg.optimizer.name,
                      recompute=recompute,
                      distributed_optimizer=_only(cfg, "parallel.distributed_optimizer")
                      or (False, True),
                      sequence_parallel=_only(cfg, "parallel.sequence_parallel") or (False, True),
                      tensor_sizes=_only(cfg, "parallel.tensor"),
                      pipeline_sizes=_only(cfg, "parallel.pipeline"),
                      data_sizes=_only(cfg, "parallel.data"),
                      micro_batches=_only(cfg, "batch.micro_batch_size"),
                      num_microbatches=_only(cfg, "batch.num_microbatches"),
                      rank_orders=_only(cfg, "parallel.rank_order") or RANK_ORDERS,
                      top_k=top_k, arch=cfg.model.family, compensation=cfg.compensation,
                      # a given --2bw-grad-buffers 2 keeps two: no one-buffer fallback
                      one_buffer=cfg.grad_buffers in (None, 1, FIRST_STAGE),
                      grad_accumulation=cfg.precision.grad_accumulation,
                      overlap_grad_reduce=cfg.parallel.overlap_grad_reduce,
                      bucket=cfg.parallel.grad_bucket_size, accept=_ramp_accepts(cfg))
    except PlanError as e:
        fixed = [f.source for f in cfg.fixed
                 if f.path in PLANNED + ("batch.global_batch_size",)]
        if not str(e).startswith("no valid layout") or not fixed:
            raise
        raise PlanError(f"auto-plan: no layout of {topology.num_gpus} processes keeps "
                        f"{' and '.join(dict.fromkeys(fixed))}: change or drop one of them"
                        ) from None


def plan(cfg: Config, topology, profile, log=None) -> Config:
    """A new Config with the fastest layout that keeps everything `cfg.fixed` names (see the
    module docstring). `log(line)` receives the summary and any warning."""
    best = search_for(cfg, topology, profile)
    chosen = Plan(best.best, best)
    L = chosen.layout
    if log is not None:
        log(chosen.summary())
        kind = schedule_kind(L.schedule)
        if L.pipeline == 1 and not kind.synchronous:
            log(f"auto-plan: warning: the fastest layout has one pipeline stage, where {L.schedule}"
                f" (fixed by {cfg.source_of('schedule')}) only adds weight staleness: a "
                "synchronous schedule (--pipeline-schedule flush) trains the same layout on "
                "exact gradients")
    return chosen.config(cfg)


__all__ = ["Plan", "plan", "planner_inputs", "search_for", "layout_flags", "partition_reason",
           "grad_buffers_reason",
           "flushes_reason"]
