"""`pretrain_gpt.py --auto-plan`: choose t, d, w, b and the rank order from the Megatron flags.

    plan = plan_for_args(args, world_size)   # raises PlanError (a ConfigError) with one line
    plan.apply(cfg)                          # fills cfg.parallel / cfg.batch / cfg.schedule

The schedule stays the one the flags name (2BW and flush/gpipe differ in semantics, not only in
speed), the global batch is `--global-batch-size`, the machine is `world_size` processes placed
as SLURM / the visible devices say (or `--plan-topology FILE`), times come from `--plan-profile
FILE` or an analytic profile (`--device-tflops`, `--device-efficiency` when those flags exist).
`plan.partition` holds the planner's stage boundaries (spec indices) if the engine is to use them
instead of the uniform split.
"""
from __future__ import annotations

from dataclasses import dataclass

from .profile import AnalyticProfile, load_profile
from .search import SearchResult, search
from .simulate import Estimate
from .topology import PlanError, resolve_topology

TOPOLOGY_FLAGS = ("gpus_per_node", "gpu_memory_gb", "intra_node_bandwidth_gbps",
                  "inter_node_bandwidth_gbps", "intra_node_latency_us", "inter_node_latency_us")


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

    def apply(self, cfg):
        L = self.layout
        cfg.parallel.tensor, cfg.parallel.pipeline, cfg.parallel.data = L.tensor, L.pipeline, L.data
        cfg.parallel.rank_order = L.rank_order
        cfg.batch.micro_batch_size = L.micro_batch
        cfg.batch.global_batch_size = L.global_batch
        cfg.schedule = L.schedule
        if L.recompute:
            cfg.model.recompute_method, cfg.model.recompute_num_layers = "uniform", 1
        else:
            cfg.model.recompute_method, cfg.model.recompute_num_layers = None, 0
        return cfg

    def flags(self) -> str:
        return layout_flags(self.layout)

    def summary(self) -> str:
        e = self.estimate
        return (f"auto-plan: {self.flags()} | predicted {e.samples_per_s:.3g} samples/s, "
                f"bubble {e.bubble:.1%}, max memory {max(e.memory_gb):.2f} GB/GPU, "
                f"partition {self.partition}")


def layout_flags(L) -> str:
    flags = (f"--tensor-model-parallel-size {L.tensor} --pipeline-model-parallel-size "
             f"{L.pipeline} --data-parallel-size {L.data} --micro-batch-size {L.micro_batch} "
             f"--global-batch-size {L.global_batch} --pipeline-schedule {L.schedule} "
             f"--rank-order {L.rank_order}")
    return flags + (" --recompute-activations" if L.recompute else "")


def plan_for_args(args, world_size: int, family: str = "gpt", allow_tensor_parallel: bool = True,
                  allow_recompute: bool = True, schedules=None) -> Plan:
    """Plan for a parsed Megatron namespace (see `arguments.py`) on `world_size` processes."""
    from ..arguments import config_from_args
    cfg = config_from_args(args, family)
    if cfg.batch.global_batch_size is None:
        raise PlanError("--auto-plan needs --global-batch-size (the planner keeps it fixed and "
                        "chooses the micro batch and the parallel sizes)")
    flags = {k: getattr(args, k, None) for k in TOPOLOGY_FLAGS}
    topo = resolve_topology(flags, getattr(args, "plan_topology", None), num_gpus=world_size)
    path = getattr(args, "plan_profile", None)
    if path:
        profile = load_profile(path)
    else:
        profile = AnalyticProfile(**{k: getattr(args, a) for k, a in
                                     (("device_tflops", "device_tflops"),
                                      ("efficiency", "device_efficiency"))
                                     if getattr(args, a, None) is not None}).validate()
    result = search(cfg.model, topo, profile, cfg.batch.global_batch_size,
                    schedules=tuple(schedules or (cfg.schedule,)), dtype=cfg.precision.dtype,
                    optimizer=cfg.optimizer.name,
                    recompute=(False, True) if allow_recompute else (False,),
                    tensor_sizes=None if allow_tensor_parallel else (1,), top_k=1,
                    arch=cfg.model.family)
    return Plan(result.best, result)


__all__ = ["Plan", "plan_for_args", "layout_flags"]
