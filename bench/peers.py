#!/usr/bin/env python
"""Throughput of the same layer stack through our engine and its peers, side by side.

    python bench/peers.py                        # 3 shapes (below), d=2, m=8, 3 interleaved repeats
    python bench/peers.py --stack mlp --repeats 5 --json peers.json
    python bench/peers.py --shapes small         # the small-compute shape only

Shapes: by default today's two (`--stack transformer` and `--stack mlp`: 4 layers, hidden 256,
seq 64, micro batch 8: 35-56 ms of forward + backward per stage and microbatch here) and the
small-compute one (SMALL: residual MLP, 8 layers, hidden 512, seq 1, micro batch 8: about 15-20
ms), where the engine's fixed costs per action decide the race, as on a GPU. Any model flag
(--num-layers, --hidden-size, ...) replaces them by the one shape the flags give.

Runs (each on d fresh gloo processes, one thread each, forked from a server that imported torch
once; the reference on one):

    ours-2bw, ours-flush, ours-gpipe   megatron_2bw.pipeline.engine.PipelineEngine
    ours-2bw-ds                        the same engine through its DeepSpeed API (the
                                       run_deepspeed script with `import megatron_2bw as
                                       deepspeed`), to compare both paths in one run
    ours-2bw-g1, ours-2bw-gfirst       2BW, --2bw-grad-buffers 1 and first (pipeline/weights.py)
    ours-2bw+predict, ...+predict-spike  the same with --2bw-compensation, one run per method
                                       (their losses are checked on batches 0, 1: batch 2 runs
                                       on a prediction)
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
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
from peer_runs import runner, unavailable_reason  # noqa: E402

from megatron_2bw.schedule.compensation_methods import NONE, method_names  # noqa: E402
from megatron_2bw.schedule.kinds import DEFAULT_SCHEDULE, schedule_kind, schedule_names

# ours-2bw+predict: 2BW with --2bw-compensation predict (pipeline/compensation.py)
OURS = tuple(f"ours-{s}" for s in schedule_names()) + tuple(
    f"ours-{s}+{m}" for s in schedule_names() if schedule_kind(s).delay == 1
    for m in method_names() if m != NONE) + tuple(
    f"ours-{s}-g{g}" for s in schedule_names() for g in schedule_kind(s).grad_buffers_choices[1:])
DS_API = (f"ours-{DEFAULT_SCHEDULE}-ds",)  # our engine through its DeepSpeed API
PEERS = ("deepspeed-1f1b", "torch-gpipe", "torch-1f1b")
BOUNDS = ("single", "no-comm")
ALL = OURS + DS_API + PEERS + BOUNDS
CHECKED_BATCHES = 3
TODAY = dict(layers=4, hidden=256, heads=8, seq=64, micro=8)   # 35-56 ms per stage here
SMALL = dict(stack="mlp", layers=8, hidden=512, heads=8, seq=1, micro=8)  # 15-20 ms
BATCHES, SMALL_BATCHES = 6, 18  # timed batches: a few seconds per run at either shape


def schedule_of(name: str) -> str | None:
    """The schedule an `ours-...` run trains with (None for the peers and bounds)."""
    if not name.startswith("ours-"):
        return None
    rest = name[len("ours-"):-len("-ds") if name.endswith("-ds") else None].partition("+")[0]
    return rest.partition("-g")[0]  # ours-2bw-g1: 2BW with --2bw-grad-buffers 1


def method_of(name: str) -> str:
    """The --2bw-compensation of an `ours-<schedule>+<method>` run ("" for the others)."""
    return name[len("ours-"):].partition("+")[2] if name.startswith("ours-") else ""


# ---- checks and the table -----------------------------------------------------------------------


def check_losses(name: str, losses: list, ref: dict, rtol: float) -> tuple[bool, str]:
    """Compare the first losses of a run with the single-process reference (the delayed-update
    one for a schedule whose batches run on older weights)."""
    schedule, method = schedule_of(name), method_of(name)
    delayed = schedule is not None and schedule_kind(schedule).delay > 0
    want = ref["losses_2bw"] if delayed else ref["losses"]
    checked = 2 if method else CHECKED_BATCHES  # compensated: batch 2 runs on a prediction
    n = min(checked, len(losses), len(want))
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
                if all(rank.get("in_waits") is not None for r in ok_runs for rank in r):
                    entry["prediction_in_waits"] = [
                        C.median([r[s]["in_waits"] for r in ok_runs]) for s in range(stages)]
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
    """(target, value, met) for the issues' throughput targets (met None: information)."""
    rate = lambda n: out.get(n, {}).get("samples_per_s")  # noqa: E731
    ours, native = f"ours-{DEFAULT_SCHEDULE}", DS_API[0]
    res = []
    if fb is not None:
        res.append(("(info) f+b of one microbatch per stage", f"{1e3 * fb / d:.1f} ms", None))
    tb = rate(ours)
    if tb and out[ours].get("vs_ideal"):
        v = out[ours]["vs_ideal"]
        res.append(("2bw >= 0.95 x ideal (d x single)", f"{v:.3f}", v >= 0.95))
    if tb and out[ours].get("vs_no_comm"):
        v = out[ours]["vs_no_comm"]
        res.append(("2bw >= 0.92 x no-comm (the same bound under this machine's contention)",
                    f"{v:.3f}", v >= 0.92))
    if tb and rate("torch-1f1b"):
        v = tb / rate("torch-1f1b")
        res.append(("2bw >= 1.08 x torch-1f1b", f"{v:.3f}", v >= 1.08))
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
    if tb and rate(native):
        v = C.paired(out, native, ours)
        res.append(("2bw through the DeepSpeed API >= 0.97 x the native engine (paired)",
                    C.with_interval(v, C.paired_interval(out, native, ours)), v >= 0.97))
    for name in OURS:  # a compensation's cost (issue 19), one gradient buffer's (32): under 3%
        if ("+" in name or name.startswith(f"{ours}-g")) and tb and rate(name):
            v = C.paired(out, name, ours)
            res.append((f"{name} >= 0.97 x 2bw (paired)",
                        C.with_interval(v, C.paired_interval(out, name, ours)), v >= 0.97))
    return res


def _ratio(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def format_result(res: dict) -> str:
    spec, runs = res["spec"], res["runs"]
    d = spec["d"]
    lines = [f"shape={spec.get('shape', 'flags')} stack={spec['stack']} layers={spec['layers']} "
             f"hidden={spec['hidden']} heads={spec['heads']} seq={spec['seq']} "
             f"micro-batch={spec['micro']} m={spec['m']} d={d} "
             f"global batch={spec['micro'] * spec['m']} timed batches={spec['batches']} "
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
    hidden = lambda e, s: (f"{100 * e['prediction_in_waits'][s]:.0f}%"  # noqa: E731
                           if e.get("prediction_in_waits") else "-")
    rows = [[name, s] + [f"{100 * share:.1f}%" for share in b.values()] + [hidden(e, s)]
            for name, e in runs.items() for s, b in enumerate(e.get("breakdown", []))]
    if rows:
        kinds = list(next(e for e in runs.values() if e.get("breakdown"))["breakdown"][0])
        lines.append("\nwhere the time goes (engine trace of the timed batches, share of the "
                     "elapsed time, median of repeats; the last column: the share of a 2BW "
                     "prediction's chunks done while waiting for a peer):")
        lines.append(C.table(["run", "stage"] + kinds + ["prediction in waits"], rows))
    for name, value, met in res["targets"]:
        verdict = "info" if met is None else "met" if met else "MISSED"
        lines.append(f"target: {name}: {value} -> {verdict}")
    return "\n".join(lines)


# ---- driver -------------------------------------------------------------------------------------


TINY = dict(layers=2, hidden=16, heads=2, seq=8, micro=2, m=4, warmup=1, batches=3, repeats=1)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stack", choices=STACKS_CHOICES, default="both")
    p.add_argument("--pipeline-stages", "-d", type=int, default=2)
    p.add_argument("--shapes", choices=("today", "small", "both"), default=None,
                   help="today's shapes (one per stack), the small-compute one, or both "
                        "(default: both, or the one shape the model flags give)")
    for flag, key in SHAPE_FLAGS.items():
        p.add_argument(flag, type=int, default=None, help=f"default {TODAY[key]}")
    p.add_argument("--num-microbatches", "-m", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--warmup-batches", type=int, default=2)
    p.add_argument("--batches", type=int, default=None,
                   help=f"timed batches per run (default {BATCHES}; {SMALL_BATCHES} at the "
                        "small-compute shape, whose batches are about 3x shorter)")
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
    given = {key: getattr(args, flag[2:].replace("-", "_")) for flag, key in SHAPE_FLAGS.items()}
    args.shape = {k: TODAY[k] if v is None else v for k, v in given.items()}
    if args.shapes is None:
        args.shapes = "today" if any(v is not None for v in given.values()) else "both"
    if args.pipeline_stages < 1 or args.shape["layers"] < args.pipeline_stages:
        p.error("--num-layers must be >= --pipeline-stages >= 1")
    for name in set(args.names) & set(OURS + DS_API):
        error = schedule_kind(schedule_of(name)).microbatch_error(
            args.pipeline_stages, args.num_microbatches, "raise --num-microbatches")
        if error:
            p.error(error)
    return args


STACKS_CHOICES = C.STACKS + ("both",)
SHAPE_FLAGS = {"--num-layers": "layers", "--hidden-size": "hidden",
               "--num-attention-heads": "heads", "--seq-length": "seq",
               "--micro-batch-size": "micro"}


def specs_from_args(args) -> list:
    """One spec per shape and stack: today's shapes (or the flags') per stack, then SMALL."""
    base = dict(d=args.pipeline_stages, m=args.num_microbatches, lr=args.lr, seed=args.seed,
                warmup=args.warmup_batches, batches=args.batches or BATCHES,
                repeats=args.repeats, breakdown=args.breakdown)
    stacks = C.STACKS if args.stack == "both" else (args.stack,)
    if args.tiny:
        return [dict(base, **TINY, stack=s, shape="tiny") for s in stacks]
    label = "today" if args.shape == {k: TODAY[k] for k in args.shape} else "flags"
    specs = []
    if args.shapes in ("today", "both"):
        specs += [dict(base, **args.shape, stack=s, shape=label) for s in stacks]
    if args.shapes in ("small", "both") and SMALL["stack"] in stacks:
        specs.append(dict(base, **SMALL, shape="small", batches=args.batches or SMALL_BATCHES))
    return specs


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
                res = C.run_spawned(runner(name), world, (spec,), timeout=timeout)
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
