"""The report of bench/memory.py: the tables (bytes per stage, bytes per parameter) and the
targets it checks, from the rows `memory.measure` returns (each stage's measured buffers and
the memory model's prediction for it)."""
from __future__ import annotations

import _common as C

STATE = ("weights", "master", "grads", "model_grad", "optimizer")  # the engine's buffers
SUBJECT = "2bw"     # the targets are about this schedule
BASELINE = "gpipe"  # ... compared with this one


def per_parameter(stage: dict) -> dict:
    """Bytes per parameter of the stage's buffers (STATE keys, "state" their sum)."""
    out = {k: stage[k] / stage["params"] for k in STATE}
    out["state"] = sum(out.values())
    return out


def targets(spec: dict, rows: list) -> list:
    d = spec["d"]
    res = _sharding_targets(spec, rows)
    by = {(r["schedule"], r["m"]): r for r in rows
          if "stages" in r and not r["distributed_optimizer"]}
    for (sched, m), r in sorted(by.items()):
        if sched != SUBJECT:
            continue
        s0 = r["stages"][0]
        res.append((f"{SUBJECT} m={m}: stage-0 stash <= d={d} microbatches",
                    f"{s0['in_flight_peak']} in flight, "
                    f"{s0['stash_peak'] / max(s0['stash_per_microbatch'], 1):.2f} x one "
                    "microbatch's stash", s0["in_flight_peak"] <= d))
    if (SUBJECT, 8) in by and (BASELINE, 8) in by:
        pairs = list(zip(by[(SUBJECT, 8)]["stages"], by[(BASELINE, 8)]["stages"]))
        ratios = [a["total"] / b["total"] for a, b in pairs]
        rss = [a["memory"]["peak_above_baseline"] / b["memory"]["peak_above_baseline"]
               for a, b in pairs
               if a["memory"]["peak_above_baseline"] and b["memory"]["peak_above_baseline"]]
        res.append((f"{SUBJECT} stage memory <= 0.6 x {BASELINE} at m=8 (buffers + stash, "
                    "worst stage)",
                    f"{max(ratios):.3f} (per stage {', '.join(f'{x:.3f}' for x in ratios)}; "
                    f"peak RSS above baseline: {', '.join(f'{x:.3f}' for x in rss)})",
                    max(ratios) <= 0.6))
    return res


def _sharding_targets(spec: dict, rows: list) -> list:
    """Per (schedule, m, stage) run with and without the distributed optimizer: its master
    weights + optimizer state are 1/w of the other's (up to padding) and equal the model's."""
    w, res = spec["w"], []
    by = {(r["schedule"], r["m"], r["distributed_optimizer"]): r for r in rows if "stages" in r}
    for (sched, m, dist), r in sorted(by.items()):
        other = by.get((sched, m, False))
        if not dist or other is None:
            continue
        for a, b in zip(r["stages"], other["stages"]):
            mine, full = a["master"] + a["optimizer"], b["master"] + b["optimizer"]
            model = a["model"]["master"] + a["model"]["optimizer"]
            padding = -(-b["params"] // w) * w - b["params"] + w  # at most w - 1 per region
            met = mine == model and abs(mine * w - full) <= padding * full / b["params"]
            res.append((f"{sched} m={m} stage {a['stage']}: distributed optimizer's master + "
                        f"optimizer bytes = 1/{w} of without it, = the memory model's",
                        f"{mine} B vs {full} B (x{mine / full:.4f}); model {model} B; "
                        f"replicas alike: {r['replicas_alike']}", met and r["replicas_alike"]))
    return res


def format_bytes_per_parameter(rows: list) -> str:
    """Bytes per parameter of every stage's buffers, measured and modelled."""
    headers = ["schedule", "m", "stage", "params", "dist. opt.", "weights", "master", "grads",
               "low-prec. grad", "optimizer", "B/param", "model B/param", "equal"]
    out = []
    for r in rows:
        for s in r.get("stages", ()):
            me, mdl = per_parameter(s), per_parameter(s["model"])
            out.append([r["schedule"], r["m"], s["stage"], s["params"],
                        "yes" if r["distributed_optimizer"] else "no"]
                       + [f"{me[k]:.3f}" for k in STATE + ("state",)]
                       + [f"{mdl['state']:.3f}",
                          "yes" if all(s[k] == s["model"][k] for k in STATE) else "NO"])
    return C.table(headers, out)


def format_rows(spec: dict, rows: list) -> str:
    headers = ["schedule", "m", "do", "stage", "versions", "weights", "master", "grads",
               "optimizer",
               "stash peak (mb)", "total", "model total", "meas/model", "peak RSS+"]
    out = []
    for r in rows:
        do = "yes" if r["distributed_optimizer"] else "no"
        if "stages" not in r:
            out.append([r["schedule"], r["m"], do, "-", r["error"]] + ["-"] * 9)
            continue
        for s in r["stages"]:
            mdl = s["model"]
            out.append([r["schedule"], r["m"], do, s["stage"], s["versions"], C.mb(s["weights"]),
                        C.mb(s["master"]), C.mb(s["grads"] + s["model_grad"]),
                        C.mb(s["optimizer"]),
                        f"{C.mb(s['stash_peak'])} ({s['in_flight_peak']})", C.mb(s["total"]),
                        f"{C.mb(mdl['total'])} ({mdl['in_flight']})",
                        f"{s['total'] / mdl['total']:.2f}" if mdl["total"] else "-",
                        C.mb(s["memory"]["peak_above_baseline"])])
    text = [f"GPT layers={spec['layers']} hidden={spec['hidden']} heads={spec['heads']} "
            f"seq={spec['seq']} vocab={spec['vocab']} micro-batch={spec['micro']} d={spec['d']} "
            f"w={spec['w']} {spec['dtype']} Adam{' recompute' if spec['recompute'] else ''}"
            f"{'' if spec['dtype'] == 'fp32' else ' --grad-accumulation ' + spec['accumulate']}; "
            "MB = 2^20 bytes",
            C.table(headers, out),
            "do: distributed optimizer; master: fp32 master weights (bf16/fp16, or the real "
            "weights of a 2BW compensation that predicts); grads: fp32 buffers + the "
            "low-precision one; optimizer: its state; stash peak (mb): peak bytes saved for "
            "backward + kept inputs/outputs over the microbatches in flight (their peak count); "
            "model total (in flight): the planner's state_bytes + activation_bytes x in_flight; peak RSS+: "
            "process peak RSS above its RSS after imports and data",
            "", "Bytes per parameter of each stage (replica 0; every data-parallel rank alike):",
            format_bytes_per_parameter(rows)]
    for name, value, met in targets(spec, rows):
        text.append(f"target: {name}: {value} -> {'met' if met else 'MISSED'}")
    return "\n".join(text)
