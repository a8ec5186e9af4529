"""Refuse, before any process group, a layout whose buffers cannot fit in the memory it will run on.

`--hidden-size 65536` would otherwise die in the first allocation with a long traceback (or get
the host OOM-killed). `check_memory(cfg, world_size, rank, local_rank)` estimates each rank's
peak bytes with the planner's memory model (`cost_model.stage_memory`: weight versions, master
weights, gradient buffers, optimizer state and the activation stash of the schedule's in-flight
microbatches, for the engine's own stage partition) and compares the ranks that share one memory
with what that memory has free:

- NCCL with CUDA: the local ranks on this rank's GPU (normally just itself) against
  `torch.cuda.mem_get_info` of that GPU;
- otherwise (gloo, CPU tensors): the local ranks of this host (`LOCAL_WORLD_SIZE` from torchrun,
  `SLURM_NTASKS_PER_NODE`, `OMPI_COMM_WORLD_LOCAL_SIZE`; just this rank when none is set)
  against the host's available memory (`MemAvailable`, lowered by a cgroup limit).

The estimate leaves out the runtime's own overhead (CUDA context, allocator slack, the Python
process), so a refusal means the run cannot fit, not that it is tight. It is one line with the
estimate, the free memory and the fixes; `--no-memory-check` skips it (for a host with swap, or
an estimate you know to be wrong).
"""
from __future__ import annotations

import os
from typing import NamedTuple

from megatron_2bw.config import Config, ConfigError
from megatron_2bw.models.flops import layer_costs
from megatron_2bw.planner.cost_model import stage_memory
from megatron_2bw.planner.memory import largest_affine_fit
from megatron_2bw.planner.topology import GB
from megatron_2bw.schedule.kinds import schedule_kind_of

_KINDS = (("weights", "weights"), ("master", "master weights"), ("grads", "gradients"),
          ("model_grad", "low-precision gradients"), ("optimizer", "optimizer state"),
          ("activations", "activations"))


class MemoryCheckError(ConfigError):
    """The layout needs more memory than the device it runs on has free (one line)."""


class DeviceMemory(NamedTuple):
    name: str                 # "host memory" or "GPU 3"
    free: int | None          # bytes; None: unknown (the check is skipped)
    gpu: int | None = None    # this rank's GPU index (None: ranks share the host's memory)
    gpus: int = 1             # GPUs on this host (local rank r uses GPU r % gpus)


def stage_estimates(cfg: Config, world_size: int) -> list[dict]:
    """Peak bytes of one rank of each pipeline stage, by kind (`stage_memory`'s dict)."""
    from megatron_2bw.models.families import model_parts  # the engine's own stage boundaries
    resolved = cfg.resolved(world_size)
    d, m = cfg.parallel.pipeline, resolved.num_microbatches
    _, _, bounds = model_parts(cfg, num_stages=d)
    costs = layer_costs(cfg.model, cfg.batch.micro_batch_size, cfg.parallel.tensor,
                        cfg.precision.dtype, cfg.model.family,
                        sequence_parallel=cfg.parallel.sequence_parallel)
    shards = resolved.data_parallel_size if cfg.parallel.distributed_optimizer else 1
    logits = 4.0 * cfg.batch.micro_batch_size * cfg.model.seq_length * cfg.model.vocab_size \
        / cfg.parallel.tensor  # one fp32 copy (GPipe's last stage keeps it per microbatch)
    return [stage_memory(costs, bounds[s], bounds[s + 1], cfg.schedule, d, m, s,
                         cfg.precision.dtype, cfg.optimizer.name, cfg.model.full_recompute,
                         None, cfg.model.selective_recompute, shards, cfg.compensation,
                         logits, cfg.grad_buffers, cfg.precision.grad_accumulation,
                         cfg.microbatches_per_flush)[0]
            for s in range(d)]


def local_world_size(env=None) -> int | None:
    """Ranks on this host, from the launcher's variables (None when it does not say)."""
    env = os.environ if env is None else env
    for var in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        value = env.get(var, "").split("(")[0]  # SLURM may write "4(x2)"
        if value.isdigit() and int(value) > 0:
            return int(value)
    return None


def host_available_bytes() -> int | None:
    """Memory this host can still give us: MemAvailable, capped by a cgroup (v2 or v1) limit."""
    values = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    values.append(int(line.split()[1]) * 1024)
    except OSError:
        try:
            values.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (ValueError, OSError, AttributeError):
            pass
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                          "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit) as f, open(usage) as g:
                cap, used = f.read().strip(), g.read().strip()
        except OSError:
            continue
        if cap.isdigit() and used.isdigit() and int(cap) < 1 << 60:
            values.append(max(int(cap) - int(used), 0))
        break
    return min(values) if values else None


def device_memory(cfg: Config, local_rank: int) -> DeviceMemory:
    """The memory this rank's tensors will live in, and how much of it is free."""
    import torch
    from megatron_2bw.parallel.devices import default_backend
    backend = cfg.parallel.backend or default_backend()
    if backend == "nccl" and torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        index = local_rank % gpus
        free, _ = torch.cuda.mem_get_info(index)
        return DeviceMemory(f"GPU {index}", int(free), index, gpus)
    return DeviceMemory("host memory", host_available_bytes())


def _gb(nbytes: float) -> str:
    return f"{nbytes / GB:.1f} GB"


def _largest_flush(cfg: Config, world_size: int, stages: list, estimates: list,
                   free: int) -> int | None:
    """GPipe: the most microbatches per flush (--gpipe-microbatches-per-flush) whose estimate
    for these ranks fits in `free` bytes, below what the config holds in flight (None: not
    GPipe, or not even one fits). A stage's bytes are affine in its in-flight microbatches."""
    kind = schedule_kind_of(cfg.schedule, cfg.grad_buffers, cfg.microbatches_per_flush)
    resolved = cfg.resolved(world_size)
    now = kind.in_flight(cfg.parallel.pipeline, resolved.num_microbatches, 0)
    if not kind.splits_into_flushes or now <= 1:
        return None
    one = stage_estimates(cfg.replace(microbatches_per_flush=1), world_size)
    base = sum(one[s]["total"] for s in stages)
    per = sum(estimates[s]["total"] - one[s]["total"] for s in stages) / (now - 1)
    return largest_affine_fit([base], [per], free, now - 1) or None


def check_memory(cfg: Config, world_size: int, rank: int = 0, local_rank: int = 0,
                 memory: DeviceMemory | None = None, local_ranks: int | None = None) -> int:
    """Raise MemoryCheckError (one line) when the ranks sharing this rank's memory need more
    than it has free; return their estimated bytes (0 when the free memory is unknown).
    `memory` and `local_ranks` replace the measured device and the launcher's count (tests)."""
    from megatron_2bw.parallel.grid import ProcessGrid
    memory = memory or device_memory(cfg, local_rank)
    if memory.free is None:
        return 0
    estimates = stage_estimates(cfg, world_size)
    first = rank - local_rank
    local = range(first, min(first + (local_ranks or local_world_size() or 1), world_size))
    sharing = [r for r in local if memory.gpu is None or (r - first) % memory.gpus == memory.gpu]
    grid = ProcessGrid(cfg.parallel.tensor, cfg.parallel.pipeline,
                       cfg.resolved(world_size).data_parallel_size,
                       rank_order=cfg.parallel.rank_order)
    stages = [grid.coords(r)[1] for r in sharing or [rank]]
    need = sum(estimates[s]["total"] for s in stages)
    if need <= memory.free:
        return int(need)
    top = max(set(stages), key=lambda s: estimates[s]["total"])
    mem = estimates[top]
    parts = ", ".join(f"{label} {_gb(mem[k])}" for k, label in _KINDS if mem[k])
    together = (f", the {len(stages)} ranks sharing {memory.name} {_gb(need)} together"
                if len(stages) > 1 else "")
    if mem["activations"] > mem["total"] / 2:
        fix = ("--recompute-activations (selective) or --recompute-granularity full, a smaller "
               "--micro-batch-size or --seq-length, --sequence-parallel with tensor "
               "parallelism, or more pipeline stages (--pipeline-model-parallel-size)")
        k = _largest_flush(cfg, world_size, stages, estimates, memory.free)
        if k:
            fix = (f"--gpipe-microbatches-per-flush {k} (the most microbatches in flight that "
                   f"fit; the same numbers), " + fix)
    else:
        fix = ("--use-distributed-optimizer with data parallelism, more pipeline stages "
               "(--pipeline-model-parallel-size) or tensor parallelism "
               "(--tensor-model-parallel-size), or a smaller --hidden-size/--num-layers")
    raise MemoryCheckError(
        f"this layout needs about {_gb(mem['total'])} per rank on pipeline stage {top} "
        f"({parts}){together}, but {memory.name} has {_gb(memory.free)} free: use {fix}, or "
        "let --auto-plan choose a layout (--no-memory-check skips this check)")
