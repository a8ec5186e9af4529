"""Topology- and memory-aware planner: profile -> cost model -> simulator -> search.

    from megatron_2bw.planner import AnalyticProfile, Topology, search
    result = search(model_cfg, Topology(num_nodes=8), AnalyticProfile(), global_batch=512)
    result.best.to_dict()

`tools/plan.py` is the command line; `plan` (Config -> Config) serves `pretrain_gpt.py --auto-plan`.

Owns: per-layer profiles (profile.py, measured by measure.py; GEMM efficiency by microbatch size: curve.py), the
machine (topology.py; which links and how many flows a layout uses: placement.py), the cost of
a layout (cost_model.py: durations; memory.py: memory per stage), timing by replaying the engine's own schedule
tables (simulate.py), the search (search.py), --auto-plan (auto.py), the pre-start memory check
(memory_check.py) and tools/plan.py (cli.py).
Must not import: tensor_parallel, data, checkpoint, deepspeed, testing, pretrain, generate.
"""
from megatron_2bw.models.partition import partition
from megatron_2bw.planner.auto import Plan, plan, planner_inputs
from megatron_2bw.planner.cost_model import Layout, Setup, StagePlan, stage_plan, state_bytes
from megatron_2bw.planner.measure import measure_profile
from megatron_2bw.planner.profile import (AnalyticProfile, MeasuredProfile, load_profile,
                                          save_profile)
from megatron_2bw.planner.search import SCHEDULES, SearchResult, search
from megatron_2bw.planner.simulate import Estimate, predict
from megatron_2bw.planner.topology import GB, PlanError, Topology, resolve_topology

__all__ = ["AnalyticProfile", "Estimate", "GB", "Layout", "MeasuredProfile", "Plan", "PlanError",
           "SCHEDULES", "SearchResult", "Setup", "StagePlan", "Topology", "load_profile",
           "measure_profile", "partition", "plan", "planner_inputs", "predict", "resolve_topology",
           "save_profile", "search", "stage_plan", "state_bytes"]
