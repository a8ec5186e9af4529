"""`tools/plan.py`: choose a parallel layout from the model, the accelerators and the links.

    python tools/plan.py --model gpt-2.7b --num-nodes 8 --gpus-per-node 8 --gpu-memory-gb 80 \\
        --global-batch-size 512 --bf16
    python tools/plan.py --model debug --profile-out cpu.json        # measure layers here
    python tools/plan.py --model debug --profile cpu.json --num-gpus 2 --global-batch-size 32

Prints the top layouts (schedule (2bw-g1: one gradient buffer), t/d/w, micro batch,
recomputation (no, sel: selective, full), distributed optimizer (do), sequence parallelism (sp),
rank order, predicted samples/s and time per batch, bubble, memory per stage, partition) and the
chosen one as flags for pretrain_gpt.py, with one line saying whether it uses the distributed
optimizer and why (the best layout of the other choice: does it fit, how much slower is it) and,
for a 2BW layout that fits only with one fp32 gradient buffer, `--2bw-grad-buffers 1` and why, or
everything as JSON with --json. Bad input: one line on stderr, exit 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from megatron_2bw.config import ModelConfig
from megatron_2bw.config.checks import check_dropouts
from megatron_2bw.config.flags import add_architecture_args, apply_architecture_args
from megatron_2bw.config.paths import check_writable_dir
from megatron_2bw.config.numbers import FiniteParser
from megatron_2bw.models.flops import model_names, named_model, num_parameters
from megatron_2bw.planner.auto import (flushes_reason, grad_buffers_reason, layout_flags,
                                       partition_reason)
from megatron_2bw.planner.measure import measure_profile
from megatron_2bw.planner.profile import AnalyticProfile, load_profile, save_profile
from megatron_2bw.planner.search import RECOMPUTE, SCHEDULES, search
from megatron_2bw.planner.topology import PlanError, resolve_topology

SHAPE = (("num_layers", int), ("hidden_size", int), ("num_attention_heads", int),
         ("ffn_hidden_size", int), ("seq_length", int), ("max_position_embeddings", int),
         ("vocab_size", int))
TOPO = (("num_nodes", int), ("gpus_per_node", int), ("gpu_memory_gb", float),
        ("intra_node_bandwidth_gbps", float), ("inter_node_bandwidth_gbps", float),
        ("intra_node_latency_us", float), ("inter_node_latency_us", float),
        ("memory_reserve_fraction", float), ("nics_per_node", int), ("nic_bandwidth_gbps", float))

TOPO_HELP = {"gpu_memory_gb": "GB (2^30 bytes) per accelerator",
             "intra_node_bandwidth_gbps": "Gbit/s per accelerator within a node",
             "inter_node_bandwidth_gbps": "Gbit/s per accelerator between nodes (the most any "
                                          "one flow gets with --nics-per-node)",
             "memory_reserve_fraction": "of each accelerator's memory kept free (default 0.1)",
             "nics_per_node": "NICs that all of a node's inter-node flows share (default 0: "
                              "each accelerator has --inter-node-bandwidth-gbps of its own)",
             "nic_bandwidth_gbps": "Gbit/s per NIC and direction (with --nics-per-node)"}


def _ints(text: str) -> tuple:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")


def build_parser() -> FiniteParser:
    p = FiniteParser(prog="tools/plan.py", description=__doc__.splitlines()[0],
                     allow_abbrev=False)
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, help=f"named shape: {', '.join(model_names())}")
    g.add_argument("--family", choices=("gpt", "bert"), default=None)
    for name, typ in SHAPE:
        g.add_argument("--" + name.replace("_", "-"), type=typ, default=None)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    for name in ("--hidden-dropout", "--attention-dropout"):  # their masks take memory
        g.add_argument(name, type=float, default=0.1,
                       help="as pretrain_gpt.py's (Megatron's) default: 0.1")
    add_architecture_args(p)
    g = p.add_argument_group("machine (defaults: SLURM / visible devices, then an A100 node)")
    g.add_argument("--num-gpus", type=int, default=None,
                   help="total; a multiple of --gpus-per-node")
    for name, typ in TOPO:
        g.add_argument("--" + name.replace("_", "-"), type=typ, default=None,
                       help=TOPO_HELP.get(name))
    g.add_argument("--topology", default=None, help="JSON file with the fields above")
    g.add_argument("--device", default=None, choices=("v100", "a100", "h100", "h200"),
                   help="built-in analytic profile with its GEMM-efficiency curve by microbatch "
                        "size (planner/curve.py); --device-tflops/--device-efficiency override")
    g.add_argument("--device-tflops", type=float, default=None, help="peak TFLOP/s (analytic)")
    g.add_argument("--device-efficiency", type=float, default=None,
                   help="achievable fraction of the peak (analytic)")
    g.add_argument("--profile", default=None, help="profile JSON (measured or analytic)")
    g = p.add_argument_group("training")
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--micro-batch-sizes", type=_ints, default=None,
                   help="restrict the micro batch sizes tried (default: all divisors)")
    g.add_argument("--tensor-sizes", type=_ints, default=None,
                   help="restrict the tensor-parallel sizes tried")
    g.add_argument("--schedules", default=",".join(SCHEDULES))
    g.add_argument("--recompute", choices=("auto", "off", "selective", "full", "on"),
                   default="auto", help="auto: try none, selective and full; on: full")
    g.add_argument("--distributed-optimizer", choices=("auto", "on", "off"), default="auto",
                   help="shard master weights and optimizer state over data-parallel ranks")
    g.add_argument("--sequence-parallel", choices=("auto", "on", "off"), default="auto",
                   help="split norms/dropout/residuals along the sequence (t > 1)")
    g.add_argument("--partition", choices=("auto", "balanced"), default="auto",
                   help="auto: stages balanced in time, or where that does not fit, the most "
                        "balanced split that does; balanced: time-balanced only (the paper's "
                        "planner)")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    g = p.add_argument_group("output")
    g.add_argument("--top", type=int, default=5)
    g.add_argument("--json", action="store_true")
    g.add_argument("--exhaustive", action="store_true", help="simulate every layout that fits")
    g.add_argument("--profile-out", default=None,
                   help="measure the model's layers on this device, write FILE and exit")
    g.add_argument("--profile-micro-batches", type=_ints, default=(1, 2, 4))
    g.add_argument("--profile-threads", type=int, default=1)
    return p


def _raise(message: str):
    raise PlanError(message)


def model_from_args(a) -> ModelConfig:
    try:
        cfg = named_model(a.model) if a.model else ModelConfig()
    except ValueError as e:
        raise PlanError(str(e)) from None
    changes = {name: getattr(a, name) for name, _ in SHAPE if getattr(a, name) is not None}
    changes.update(hidden_dropout=a.hidden_dropout, attention_dropout=a.attention_dropout)
    check_dropouts(dataclasses.replace(cfg, **changes), error=_raise)
    if a.untie_embeddings_and_output_weights:
        changes["untie_embeddings_and_output_weights"] = True
    if a.family:
        changes["family"] = a.family
    return apply_architecture_args(dataclasses.replace(cfg, **changes), a)


def _table(result, model, topo) -> str:
    nics = (f", {topo.nics_per_node} x {topo.nic_bandwidth_gbps:g} Gbit/s NIC"
            f"{'s' if topo.nics_per_node > 1 else ''} per node" if topo.nics_per_node else "")
    rows = [f"plan for {model.num_layers} layers x hidden {model.hidden_size} "
            f"({num_parameters(model) / 1e9:.3g}B parameters) on {topo.num_nodes} x "
            f"{topo.gpus_per_node} GPUs ({topo.gpu_memory_gb:g} GB, "
            f"{topo.intra_node_bandwidth_gbps:g}/{topo.inter_node_bandwidth_gbps:g} Gbit/s"
            f"{nics}): "
            f"{result.considered} layouts, {result.examined} planned ({result.fitting} fit), "
            f"{result.simulated} simulated "
            f"in {result.seconds:.2f} s",
            f"{'#':>2} {'sched':6} {'t':>2} {'d':>3} {'w':>4} {'b':>4} {'m':>5} {'rc':4} "
            f"{'do':3} {'sp':3} {'order':9} {'samples/s':>10} {'s/batch':>9} {'bubble':>7} "
            f"{'max GB':>7}  GB per stage / partition"]
    for i, e in enumerate(result.ranked, 1):
        L, gb = e.layout, e.memory_gb
        per = " ".join(f"{x:.1f}" for x in gb[:6]) + (" ..." if len(gb) > 6 else "")
        bounds = e.plan.bounds
        part = str(bounds) if len(bounds) <= 9 else f"[{bounds[0]}, {bounds[1]}, ..., {bounds[-1]}]"
        sched = L.schedule + (f"-g{L.grad_buffers}" if L.grad_buffers else "") + (
            f"-f{L.microbatches_per_flush}" if L.microbatches_per_flush else "")  # 2bw-g1, gpipe-f2
        rows.append(f"{i:>2} {sched:6} {L.tensor:>2} {L.pipeline:>3} {L.data:>4} "
                    f"{L.micro_batch:>4} {L.num_microbatches:>5} {L.recompute_name:4} "
                    f"{_yes(L.distributed_optimizer):3} {_yes(L.sequence_parallel):3} "
                    f"{L.rank_order:9} {e.samples_per_s:>10.4g} {e.time_per_batch:>9.4g} "
                    f"{e.bubble:>7.1%} {max(gb):>7.2f}  {per} / {part}")
    return "\n".join(rows)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def explain_distributed_optimizer(best, search_other) -> str:
    """One line: whether the chosen layout uses the distributed optimizer, and why.
    `search_other(flag)` is the same search restricted to the other choice (its best Estimate,
    or a PlanError when nothing fits)."""
    L = best.layout
    if L.data == 1 and not L.distributed_optimizer:
        return ("distributed optimizer: no: the chosen layout has one data-parallel replica "
                "(w = 1), there is nothing to shard across")
    uses = L.distributed_optimizer
    saved = max(m["master"] + m["optimizer"] for m in best.plan.memory)
    try:
        other = search_other(not uses)
    except PlanError as e:
        if uses:
            return (f"distributed optimizer: yes: without it no layout fits ({e}); sharding "
                    f"the master weights and optimizer state over w = {L.data} leaves "
                    f"{saved / 2 ** 30:.2f} GB of them per GPU")
        return f"distributed optimizer: no: no layout with it fits ({e})"
    slower = other.time_per_batch / best.time_per_batch - 1
    what = (f"the best layout {'without' if uses else 'with'} it ({other.layout.describe()}, "
            f"max {max(other.memory_gb):.2f} GB) is {slower:.1%} slower")
    if uses:
        return (f"distributed optimizer: yes: {what}; it keeps {saved / 2 ** 30:.2f} GB of "
                f"master weights and optimizer state per GPU (1/{L.data} of the stage's)")
    return (f"distributed optimizer: no: {what} (its all-gather of the new weights after every "
            "step costs more than the memory it frees buys here)")


def run(argv=None, out=sys.stdout) -> int:
    a = build_parser().parse_args(argv)
    model = model_from_args(a)
    dtype = "fp16" if a.fp16 else ("bf16" if a.bf16 else "fp32")
    if a.fp16 and a.bf16:
        raise PlanError("--fp16 and --bf16 are mutually exclusive: pick one")
    if a.profile_out:  # where it goes is checked before the minutes of measuring
        check_writable_dir(os.path.dirname(os.path.abspath(a.profile_out)),
                           "--profile-out (its directory)", PlanError)
        if os.path.isdir(a.profile_out):
            raise PlanError(f"--profile-out {a.profile_out} is a directory: name a file")
        prof = measure_profile(model, a.profile_micro_batches, dtype, threads=a.profile_threads)
        save_profile(prof, a.profile_out)
        fwd = prof.layers["transformer"][a.profile_micro_batches[-1]][0]
        alpha, beta = prof.curve()  # its own GEMM-efficiency curve: t(b) = alpha + beta*b
        half = alpha / beta * model.seq_length if beta > 0 else 0.0
        print(f"wrote {a.profile_out}: {prof.device}, micro batches "
              f"{list(a.profile_micro_batches)}, transformer layer forward {fwd * 1e3:.3g} ms; "
              f"fitted curve: half efficiency at {half:.0f} tokens per microbatch", file=out)
        return 0
    if a.global_batch_size is None:
        raise PlanError("--global-batch-size is required: the planner keeps it fixed")
    topo = resolve_topology({name: getattr(a, name) for name, _ in TOPO}, a.topology,
                            num_gpus=a.num_gpus)
    if a.profile:
        profile = load_profile(a.profile)
    else:
        given = {k: v for k, v in (("device_tflops", a.device_tflops),
                                   ("efficiency", a.device_efficiency)) if v is not None}
        profile = AnalyticProfile.for_device(a.device, **given) if a.device else \
            AnalyticProfile(**given).validate()
    recompute = {"auto": RECOMPUTE, "on": (True,), "full": (True,), "off": (False,),
                 "selective": ("selective",)}[a.recompute]
    choice = {"auto": (False, True), "on": (True,), "off": (False,)}
    if a.top < 1:
        raise PlanError(f"--top must be >= 1, got {a.top}")
    kwargs = dict(schedules=tuple(s.strip() for s in a.schedules.split(",") if s.strip()),
                  dtype=dtype, optimizer=a.optimizer, recompute=recompute,
                  tensor_sizes=a.tensor_sizes, micro_batches=a.micro_batch_sizes,
                  exhaustive=a.exhaustive, arch=getattr(model, "family", "gpt"),
                  sequence_parallel=choice[a.sequence_parallel],
                  fit_partition=a.partition == "auto")
    # one search: the best layout overall and the best of each distributed-optimizer choice
    # (what the explanation compares with), when both are allowed
    both = a.distributed_optimizer == "auto"
    result = search(model, topo, profile, a.global_batch_size, top_k=a.top,
                    distributed_optimizer=choice[a.distributed_optimizer],
                    group=(lambda L: L.distributed_optimizer) if both else None, **kwargs)
    best = result.best
    flags = layout_flags(best.layout, best.plan.bounds)

    def best_with(flag: bool):
        if both:
            if flag in result.best_by:
                return result.best_by[flag]
            if flag not in result.smallest_by:
                raise PlanError(f"no valid layout {'with' if flag else 'without'} it")
            raise PlanError(f"does not fit: smallest footprint {result.smallest_by[flag]:.2f} GB "
                            f"> {topo.usable_memory_gb:.2f} GB usable per GPU")
        return search(model, topo, profile, a.global_batch_size, top_k=1,
                      distributed_optimizer=(flag,), **kwargs).best
    why = explain_distributed_optimizer(best, best_with)
    buffers, flushes = grad_buffers_reason(best, topo), flushes_reason(best, topo)
    moved = partition_reason(best, topo)
    if a.json:
        json.dump({"chosen": best.to_dict(), "flags": flags, "distributed_optimizer": why,
                   "grad_buffers": buffers, "gpipe_flushes": flushes, "partition": moved,
                   "candidates": [e.to_dict() for e in result.ranked[:a.top]],
                   "considered": result.considered, "examined": result.examined,
                   "fitting": result.fitting,
                   "simulated": result.simulated, "seconds": result.seconds,
                   "topology": json.loads(topo.to_json())}, out, indent=2)
        out.write("\n")
        return 0
    result.ranked = result.ranked[:a.top]
    print(_table(result, model, topo), file=out)
    print(f"\nchosen ({best.samples_per_s:.4g} samples/s predicted, {best.source}):\n  {flags}",
          file=out)
    print(f"  stage partition (spec indices, embedding=0, head={model.num_layers + 1}): "
          f"{best.plan.bounds}", file=out)
    print(f"  {why}", file=out)
    for reason in (buffers, flushes, moved):
        if reason:
            print(f"  {reason}", file=out)
    return 0


def main(argv=None) -> int:
    try:
        return run(argv)
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


__all__ = ["main", "run", "build_parser"]
