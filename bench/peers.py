#!/usr/bin/env python
"""Throughput of the same layer stack through our engine and its peers, side by side.

    python bench/peers.py                        # both stacks, d=2, m=8, 3 interleaved repeats
    python bench/peers.py --stack mlp --repeats 5 --json peers.json

Runs (each on d fresh gloo processes, one thread each, forked from a server that imported torch
once; the reference on one):

    ours-2bw, ours-flush, ours-gpipe   megatron_2bw.pipeline.engine.PipelineEngine
    deepspeed-1f1b                     deepspeed.pipe.PipelineModule + DeepSpeed's PipelineEngine
                                       (its TrainSchedule: 1F1B with a flush)
    torch-gpipe, torch-1f1b            torch.distributed.pipelining ScheduleGPipe / Schedule1F1B
    single                             one process, the same microbatches, gradient accumulation:
                                       the ideal d-stage pipeline runs at d times its throughput
    no-comm                            d processes at once, each training only its stage's layers
                                       on the same microbatches with no communication and no
                                       bubble (random stand-ins for received tensors): what a
                                       perfect pipeline gets from this machine while d processes
                                       share its cores, caches and memory bandwidth

All train the same stack (`--stack transformer`: pre-norm causal attention + MLP blocks;
`--stack mlp`: residual MLP blocks; layer i is built from seed + i by every peer, so every run
starts from identical weights), the same microbatches (b x s x h inputs, MSE to a random target),
Adam (lr --lr, no weight decay, no clipping), fp32. A run is `--warmup-batches` untimed batches,
then `--batches` timed ones between two barriers (steady state; 2BW never drains inside the
timed part, as in a long training run). Repeats are interleaved (A B C ... A B C ..., the order
rotated each repeat) and the table shows medians. Before any number counts, each run's first
losses are compared with the single-process reference (rtol --rtol): batches 0..2 for the
one-version schedules; for 2BW, batch 0 (identical) and batches 1, 2 against the delayed-update
reference (loss of batch t on W(max(t-1, 0))). A run that fails that check is shown as "broken"
and excluded; a peer that cannot run here is shown as "unavailable: reason".
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

OURS = ("ours-2bw", "ours-flush", "ours-gpipe")
PEERS = ("deepspeed-1f1b", "torch-gpipe", "torch-1f1b")
BOUNDS = ("single", "no-comm")
ALL = OURS + PEERS + BOUNDS
CHECKED_BATCHES = 3


# ---- one run on one rank ------------------------------------------------------------------------


def _timed_loop(step, spec, barrier):
    """Run warm-up + timed batches; return (elapsed seconds of the timed ones, losses)."""
    losses, t0 = [], None
    for t in range(spec["warmup"] + spec["batches"]):
        if t == spec["warmup"]:
            barrier()
            t0 = time.perf_counter()
        losses.append(step(t))
    barrier()
    elapsed = time.perf_counter() - t0
    return elapsed, losses


def _data(spec, rank, d):
    """This rank's microbatches (only the first and last stage read data); one batch more than
    the run steps through, because a 2BW window already starts the next batch's forwards."""
    n = (spec["warmup"] + spec["batches"] + 1) * spec["m"]
    if rank not in (0, d - 1):
        return [(None, None)] * n
    return C.microbatches(n, spec["micro"], spec["seq"], spec["hidden"], spec["seed"])


def _barrier():
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()


def _floats(xs):
    return [None if x is None else float(x) for x in xs]


def run_ours(rank, world, spec, schedule):
    from megatron_2bw.config import (BatchConfig, Config, OptimizerConfig, ParallelConfig,
                                     TrainConfig)
    from megatron_2bw.parallel.grid import ProcessGrid
    from megatron_2bw.pipeline.engine import PipelineEngine
    from megatron_2bw.pipeline.module import LayerSpec
    d, m, b = world, spec["m"], spec["micro"]
    data = _data(spec, rank, d)
    C.framework_warmup()
    probe = C.MemoryProbe()
    cfg = Config(schedule=schedule, parallel=ParallelConfig(pipeline=d),
                 batch=BatchConfig(micro_batch_size=b, global_batch_size=b * m),
                 optimizer=OptimizerConfig(lr=spec["lr"], weight_decay=0.0, clip_grad=0.0),
                 train=TrainConfig(train_iters=spec["warmup"] + spec["batches"],
                                   seed=spec["seed"]))
    grid = ProcessGrid(1, d, 1, rank=rank).init_groups()
    specs = [LayerSpec(functools.partial(C.build_layer, spec["stack"], i, spec["hidden"],
                                         spec["heads"], spec["seed"]), name=spec["stack"])
             for i in range(spec["layers"])]
    engine = PipelineEngine(cfg, grid, specs, C.loss_fn, C.partition(spec["layers"], d), "cpu")
    it = iter(data)

    def step(t):
        if t == spec["warmup"] and spec.get("breakdown"):
            engine.enable_trace()
        return engine.train_batch(it)

    elapsed, losses = _timed_loop(step, spec, _barrier)
    out = {"elapsed": elapsed, "losses": _floats(losses), "memory": probe.result()}
    if engine.trace is not None:
        out["breakdown"] = breakdown(engine.trace, elapsed)
    return out


def breakdown(trace: list, elapsed: float) -> dict:
    """Seconds per kind of action in an engine trace: F, B, p2p (posting + waiting for the
    neighbour), R/N/S (reductions and the optimizer step), and the rest of the elapsed time
    (Python between actions, the timed loop, the final barrier)."""
    out = {"F": 0.0, "B": 0.0, "p2p": 0.0, "R/N/S": 0.0}
    for label, start, end in trace:
        k = label[0]
        out["F" if k == "F" else "B" if k == "B" else "R/N/S" if k in "RNS" else "p2p"] += \
            end - start
    out["other"] = elapsed - sum(out.values())
    return out


def run_deepspeed(rank, world, spec):
    import importlib
    import deepspeed
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # no C++ build
    from deepspeed.pipe import LayerSpec, PipelineModule
    d, m, b = world, spec["m"], spec["micro"]
    data = _data(spec, rank, d)
    C.framework_warmup()
    probe = C.MemoryProbe()
    deepspeed.init_distributed(dist_backend="gloo")
    layer = C.LAYERS[spec["stack"]]
    net = PipelineModule(layers=[LayerSpec(layer, i, spec["hidden"], spec["heads"], spec["seed"])
                                 for i in range(spec["layers"])],
                         num_stages=d, loss_fn=C.loss_fn, partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": b, "gradient_accumulation_steps": m,
              "optimizer": {"type": "Adam", "params": {"lr": spec["lr"], "betas": [0.9, 0.999],
                                                       "eps": 1e-8, "weight_decay": 0.0,
                                                       "torch_adam": True}},
              "gradient_clipping": 0.0, "steps_per_print": 10 ** 9,
              "wall_clock_breakdown": False}
    engine, _, _, _ = deepspeed.initialize(
        model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
        config=config)
    it = iter(data)
    elapsed, losses = _timed_loop(lambda t: engine.train_batch(data_iter=it), spec, _barrier)
    return {"elapsed": elapsed, "losses": _floats(losses), "memory": probe.result()}


def run_torch(rank, world, spec, schedule):
    import torch
    from torch import nn
    from torch.distributed import pipelining as P
    d, m = world, spec["m"]
    data = _data(spec, rank, d)
    per_batch = [(torch.cat([x for x, _ in data[t * m:(t + 1) * m]]),
                  torch.cat([y for _, y in data[t * m:(t + 1) * m]]))
                 if rank in (0, d - 1) else (None, None)
                 for t in range(spec["warmup"] + spec["batches"])]
    del data
    C.framework_warmup()
    probe = C.MemoryProbe()
    lo, hi = C.partition(spec["layers"], d)[rank:rank + 2]
    module = nn.Sequential(*[C.build_layer(spec["stack"], i, spec["hidden"], spec["heads"],
                                           spec["seed"]) for i in range(lo, hi)])
    stage = P.PipelineStage(module, rank, d, torch.device("cpu"))
    cls = {"gpipe": P.ScheduleGPipe, "1f1b": P.Schedule1F1B}[schedule]
    sched = cls(stage, n_microbatches=m, loss_fn=C.loss_fn, scale_grads=True)
    opt = torch.optim.Adam(module.parameters(), lr=spec["lr"])

    def step(t):
        x, y = per_batch[t]
        losses = []
        if rank == 0 and d > 1:
            sched.step(x, return_outputs=False)
        elif rank == d - 1:
            args = (x,) if d == 1 else ()
            sched.step(*args, target=y, losses=losses, return_outputs=False)
        else:
            sched.step(return_outputs=False)
        opt.step()
        opt.zero_grad()
        return torch.stack(losses).mean() if losses else None

    elapsed, losses = _timed_loop(step, spec, _barrier)
    return {"elapsed": elapsed, "losses": _floats(losses), "memory": probe.result()}


def run_single(rank, world, spec):
    """The reference: one process, the whole stack, gradient accumulation over m microbatches.
    Also computes, untimed, the losses the 2BW semantics give for batches 0..2."""
    import copy

    import torch
    from torch import nn
    m = spec["m"]
    data = C.microbatches((spec["warmup"] + spec["batches"]) * m, spec["micro"], spec["seq"],
                          spec["hidden"], spec["seed"])
    C.framework_warmup()
    probe = C.MemoryProbe()
    model = nn.Sequential(*[C.build_layer(spec["stack"], i, spec["hidden"], spec["heads"],
                                          spec["seed"]) for i in range(spec["layers"])])
    check_model = copy.deepcopy(model)

    def batch_loss(net, t, grad=True):
        total = torch.zeros(())
        for x, y in data[t * m:(t + 1) * m]:
            if grad:
                loss = C.loss_fn(net(x), y)
                (loss / m).backward()
            else:
                with torch.no_grad():
                    loss = C.loss_fn(net(x), y)
            total += loss.detach() / m
        return total

    # 2BW reference: batch t runs on W(max(t-1, 0)); W(1) = step(W(0), g_0(W(0))) as usual
    opt = torch.optim.Adam(check_model.parameters(), lr=spec["lr"])
    twobw = [batch_loss(check_model, 0), batch_loss(check_model, 1, grad=False)]
    opt.step()
    twobw.append(batch_loss(check_model, 2, grad=False))
    del check_model, opt

    opt = torch.optim.Adam(model.parameters(), lr=spec["lr"])

    def step(t):
        loss = batch_loss(model, t)
        opt.step()
        opt.zero_grad()
        return loss

    elapsed, losses = _timed_loop(step, spec, lambda: None)
    return {"elapsed": elapsed, "losses": _floats(losses), "losses_2bw": _floats(twobw),
            "memory": probe.result()}


def run_no_comm(rank, world, spec):
    """Stage `rank` alone: forward + backward of its layers per microbatch, Adam step per batch,
    no p2p (inputs/gradients from other stages replaced by random tensors of the same shape)."""
    import torch
    from torch import nn
    d, m, b = world, spec["m"], spec["micro"]
    shape = (b, spec["seq"], spec["hidden"])
    data = _data(spec, 0, 1)
    g = torch.Generator().manual_seed(rank)
    stand_in = [torch.randn(*shape, generator=g) for _ in range(2)]
    C.framework_warmup()
    probe = C.MemoryProbe()
    lo, hi = C.partition(spec["layers"], d)[rank:rank + 2]
    module = nn.Sequential(*[C.build_layer(spec["stack"], i, spec["hidden"], spec["heads"],
                                           spec["seed"]) for i in range(lo, hi)])
    opt = torch.optim.Adam(module.parameters(), lr=spec["lr"])

    def step(t):
        total = torch.zeros(())
        for x, y in data[t * m:(t + 1) * m]:
            if rank > 0:
                x = stand_in[0].clone().requires_grad_()
            out = module(x)
            if rank == d - 1:
                loss = C.loss_fn(out, y)
                (loss / m).backward()
                total += loss.detach() / m
            else:
                out.backward(stand_in[1])
        opt.step()
        opt.zero_grad()
        return total if d == 1 else None

    elapsed, losses = _timed_loop(step, spec, _barrier)
    return {"elapsed": elapsed, "losses": _floats(losses), "memory": probe.result()}


def _runner(name: str):
    if name.startswith("ours-"):
        return functools.partial(run_ours, schedule=name[5:])
    if name.startswith("torch-"):
        return functools.partial(run_torch, schedule=name[6:])
    if name == "deepspeed-1f1b":
        return run_deepspeed
    if name == "no-comm":
        return run_no_comm
    return run_single


def unavailable_reason(name: str) -> str | None:
    import importlib.util
    if name == "deepspeed-1f1b" and importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed (pip install deepspeed)"
    if name.startswith("torch-"):
        try:
            from torch.distributed import pipelining as P
            cls = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}[name[6:]]
            getattr(P, cls)
        except (ImportError, AttributeError) as e:
            return f"torch.distributed.pipelining not usable in this torch: {e}"
    return None


# ---- checks and the table -----------------------------------------------------------------------


def check_losses(name: str, losses: list, ref: dict, rtol: float) -> tuple[bool, str]:
    """Compare the first losses of a run with the single-process reference."""
    want = ref["losses_2bw"] if name == "ours-2bw" else ref["losses"]
    n = min(CHECKED_BATCHES, len(losses), len(want))
    worst = 0.0
    for t in range(n):
        if losses[t] is None:
            return False, f"no loss for batch {t}"
        err = abs(losses[t] - want[t]) / max(abs(want[t]), 1e-12)
        worst = max(worst, err)
        if not err <= rtol:
            return False, f"batch {t}: loss {losses[t]:.6g} != reference {want[t]:.6g}"
    return True, f"{n} batches, max rel diff {worst:.1e}"


def _run_losses(results: list) -> list:
    """The per-batch losses a run reports (the last stage always has them)."""
    return results[-1]["losses"]


def summarize(spec: dict, names: list, runs: dict, rtol: float) -> dict:
    """runs: name -> list of per-repeat outcomes (list of per-rank results, or an error string)."""
    d, samples = spec["d"], spec["micro"] * spec["m"] * spec["batches"]
    ref_runs = [r for r in runs.get("single", []) if not isinstance(r, str)]
    ref = ref_runs[0][0] if ref_runs else None
    out = {}
    for name in names:
        ok_runs, errors, check = [], [], None
        for r in runs.get(name, []):
            if isinstance(r, str):
                errors.append(r)
                continue
            if name == "no-comm":
                check = "n/a (no model output)"
            elif name == "single":
                check = "reference"
            elif ref is None:
                check = "unchecked (no reference)"
            else:
                good, check = check_losses(name, _run_losses(r), ref, rtol)
                if not good:
                    errors.append(f"broken: {check}")
                    continue
            ok_runs.append(r)
        entry = {"status": "ok", "repeats": len(ok_runs), "check": check}
        if not ok_runs:
            reason = errors[0] if errors else "not run"
            entry["status"] = reason if reason.startswith("broken") else f"unavailable: {reason}"
        else:
            rates = [samples / max(rank["elapsed"] for rank in r) for r in ok_runs]
            entry["samples_per_s_runs"] = rates
            entry["samples_per_s"] = C.median(rates)
            stages = len(ok_runs[0])
            entry["peak_memory_above_baseline"] = [
                C.median([r[s]["memory"]["peak_above_baseline"] for r in ok_runs])
                for s in range(stages)]
            entry["peak_rss"] = [C.median([r[s]["memory"]["peak_rss"] for r in ok_runs])
                                 for s in range(stages)]
            if all("breakdown" in rank for r in ok_runs for rank in r):
                # per stage, the median over repeats of each kind's share of the elapsed time
                entry["breakdown"] = [
                    {k: C.median([r[s]["breakdown"][k] / r[s]["elapsed"] for r in ok_runs])
                     for k in ok_runs[0][s]["breakdown"]} for s in range(stages)]
        if errors:
            entry["failed_repeats"] = errors
        out[name] = entry
    rate = lambda n: out.get(n, {}).get("samples_per_s")  # noqa: E731
    ideal = d * rate("single") if rate("single") else None
    peer_rates = {n: rate(n) for n in PEERS if rate(n)}
    best_peer = max(peer_rates, key=peer_rates.get) if peer_rates else None
    for name, e in out.items():
        r = e.get("samples_per_s")
        e["vs_ideal"] = r / ideal if r and ideal and name != "single" else None
        e["vs_no_comm"] = r / rate("no-comm") if r and rate("no-comm") and name != "single" \
            else None
        e["vs_best_peer"] = r / peer_rates[best_peer] if r and best_peer else None
    fb = None
    if ref_runs:
        fb = C.median([r[0]["elapsed"] / (spec["batches"] * spec["m"]) for r in ref_runs])
    return {"spec": spec, "runs": out, "ideal_samples_per_s": ideal, "best_peer": best_peer,
            "ms_per_microbatch_whole_model": None if fb is None else 1e3 * fb,
            "ms_per_microbatch_per_stage": None if fb is None else 1e3 * fb / d,
            "targets": [list(t) for t in targets(out, best_peer, fb, d)]}


def targets(out: dict, best_peer, fb, d) -> list:
    """(target, value, met) for the issue's throughput targets."""
    rate = lambda n: out.get(n, {}).get("samples_per_s")  # noqa: E731
    res = []
    tb = rate("ours-2bw")
    if fb is not None:
        res.append(("premise: f+b of one microbatch per stage >= 20 ms",
                    f"{1e3 * fb / d:.1f} ms", 1e3 * fb / d >= 20))
    if tb and out["ours-2bw"].get("vs_ideal"):
        v = out["ours-2bw"]["vs_ideal"]
        res.append(("2bw >= 0.95 x ideal (d x single)", f"{v:.3f}", v >= 0.95))
    if tb and out["ours-2bw"].get("vs_no_comm"):
        v = out["ours-2bw"]["vs_no_comm"]
        res.append(("(info) 2bw >= 0.95 x no-comm (the same bound under this machine's "
                    "contention)", f"{v:.3f}", v >= 0.95))
    if tb and best_peer:
        v = tb / rate(best_peer)
        res.append((f"2bw >= 1.25 x best peer ({best_peer})", f"{v:.3f}", v >= 1.25))
    if tb and rate("ours-gpipe"):
        v = tb / rate("ours-gpipe")
        res.append(("2bw >= 1.10 x our gpipe", f"{v:.3f}", v >= 1.10))
    for peer in ("deepspeed-1f1b", "torch-1f1b"):
        if rate("ours-flush") and rate(peer):
            v = rate("ours-flush") / rate(peer)
            res.append((f"our flush >= {peer}", f"{v:.3f}", v >= 1.0))
    return res


def _ratio(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def format_result(res: dict) -> str:
    spec, runs = res["spec"], res["runs"]
    d = spec["d"]
    lines = [f"stack={spec['stack']} layers={spec['layers']} hidden={spec['hidden']} "
             f"heads={spec['heads']} seq={spec['seq']} micro-batch={spec['micro']} m={spec['m']} "
             f"d={d} global batch={spec['micro'] * spec['m']} timed batches={spec['batches']} "
             f"repeats={spec['repeats']}"]
    fb = res["ms_per_microbatch_whole_model"]
    if fb is not None:
        lines.append(f"single process: {fb:.1f} ms per microbatch (f+b, step amortized), "
                     f"{fb / d:.1f} ms per stage")
    headers = ["run", "samples/s", "min-max", "vs ideal", "vs no-comm", "vs best peer"] + \
        [f"stage {s} MB" for s in range(d)] + ["loss check"]
    rows = []
    for name, e in runs.items():
        if e.get("samples_per_s") is None:
            rows.append([name, e["status"]] + ["-"] * (4 + d) + ["-"])
            continue
        mem = (list(e["peak_memory_above_baseline"]) + ["-"] * d)[:d]
        lo, hi = min(e["samples_per_s_runs"]), max(e["samples_per_s_runs"])
        rows.append([name, f"{e['samples_per_s']:.2f}", f"{lo:.1f}-{hi:.1f}", _ratio(e["vs_ideal"]),
                     _ratio(e["vs_no_comm"]), _ratio(e["vs_best_peer"])] +
                    [m if isinstance(m, str) else C.mb(m) for m in mem] + [e["check"] or "-"])
    if res["ideal_samples_per_s"]:
        rows.append(["ideal (d x single)", f"{res['ideal_samples_per_s']:.2f}", "-", "1.000"] +
                    ["-"] * (2 + d) + ["-"])
    lines.append(C.table(headers, rows))
    lines.append("samples/s: median over repeats; stage MB: peak RSS above the RSS after imports "
                 "and data (median)")
    for name, e in runs.items():
        for err in e.get("failed_repeats", []) if e.get("samples_per_s") else []:
            lines.append(f"note: {name}: a repeat failed and was not counted: {err}")
    rows = [[name, s] + [f"{100 * share:.1f}%" for share in b.values()]
            for name, e in runs.items() for s, b in enumerate(e.get("breakdown", []))]
    if rows:
        kinds = list(next(e for e in runs.values() if e.get("breakdown"))["breakdown"][0])
        lines.append("\nwhere the time goes (engine trace of the timed batches, share of the "
                     "elapsed time, median of repeats):")
        lines.append(C.table(["run", "stage"] + kinds, rows))
    for name, value, met in res["targets"]:
        lines.append(f"target: {name}: {value} -> {'met' if met else 'MISSED'}")
    return "\n".join(lines)


# ---- driver -------------------------------------------------------------------------------------


TINY = dict(layers=2, hidden=16, heads=2, seq=8, micro=2, m=4, warmup=1, batches=3, repeats=1)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stack", choices=STACKS_CHOICES, default="both")
    p.add_argument("--pipeline-stages", "-d", type=int, default=2)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--num-microbatches", "-m", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--warmup-batches", type=int, default=2)
    p.add_argument("--batches", type=int, default=6, help="timed batches per run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--runs", default=",".join(ALL),
                   help=f"comma-separated subset of {','.join(ALL)} (single is always run)")
    p.add_argument("--rtol", type=float, default=1e-4, help="loss check tolerance")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    p.add_argument("--json", default=None, help="write the results as JSON (- for stdout)")
    p.add_argument("--breakdown", action="store_true",
                   help="trace our engine's timed batches and show where the time goes "
                        "(F, B, p2p, R/N/S, other) per stage")
    p.add_argument("--tiny", action="store_true", help="a seconds-long smoke run (tests)")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    bad = [n for n in names if n not in ALL]
    if bad:
        p.error(f"unknown run(s) {', '.join(bad)}: choose from {', '.join(ALL)}")
    if "single" not in names:
        names.append("single")
    args.names = [n for n in ALL if n in names]
    if args.pipeline_stages < 1 or args.num_layers < args.pipeline_stages:
        p.error("--num-layers must be >= --pipeline-stages >= 1")
    if "ours-2bw" in args.names and args.num_microbatches < args.pipeline_stages:
        p.error(f"2bw needs --num-microbatches >= --pipeline-stages ({args.pipeline_stages})")
    return args


STACKS_CHOICES = C.STACKS + ("both",)


def specs_from_args(args) -> list:
    base = dict(d=args.pipeline_stages, layers=args.num_layers, hidden=args.hidden_size,
                heads=args.num_attention_heads, seq=args.seq_length, micro=args.micro_batch_size,
                m=args.num_microbatches, lr=args.lr, seed=args.seed, warmup=args.warmup_batches,
                batches=args.batches, repeats=args.repeats, breakdown=args.breakdown)
    if args.tiny:
        base.update(TINY)
    stacks = C.STACKS if args.stack == "both" else (args.stack,)
    return [dict(base, stack=s) for s in stacks]


def bench(spec: dict, names: list, timeout: float, rtol: float, log=print) -> dict:
    runs = {n: [] for n in names}
    skip = {n: unavailable_reason(n) for n in names}
    for n, reason in skip.items():
        if reason:
            runs[n].append(reason)
    order = [n for n in names if not skip[n]]
    for rep in range(spec["repeats"] if order else 0):
        k = rep % len(order)
        for name in order[k:] + order[:k]:  # interleaved, rotated each repeat
            world = 1 if name == "single" else spec["d"]
            t0 = time.time()
            try:
                res = C.run_spawned(_runner(name), world, (spec,), timeout=timeout)
                runs[name].append(res)
                el = max(r["elapsed"] for r in res)
                log(f"  [{spec['stack']}] repeat {rep + 1}/{spec['repeats']} {name}: "
                    f"{spec['micro'] * spec['m'] * spec['batches'] / el:.2f} samples/s "
                    f"({time.time() - t0:.0f} s with start-up)")
            except C.RunError as e:
                runs[name].append(str(e))
                log(f"  [{spec['stack']}] repeat {rep + 1}/{spec['repeats']} {name}: FAILED {e}")
    return summarize(spec, names, runs, rtol)


def main(argv=None) -> int:
    args = parse(argv)
    header = f"# bench/peers.py  {C.stamp()}\n# {C.command_line()}"
    print(header, flush=True)
    results = []
    for spec in specs_from_args(args):
        res = bench(spec, args.names, args.timeout, args.rtol,
                    log=lambda s: print(s, file=sys.stderr, flush=True))
        results.append(res)
        print()
        print(format_result(res), flush=True)
    if args.json:
        C.write_json(args.json, {"date": C.stamp(), "command": C.command_line(),
                                 "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
