"""Reading what tools/gpu_check.py's steps left behind, and its verdict.

- the pretrain logs (training/observe/logger.py's lines, the start-up `kernels:` line of
  training/kernels.py),
- the engine's --trace of the resume step (tools/plot_schedule.py reads it),
- the torch.profiler trace of two resumed iterations (--profile): which scaled-dot-product
  attention kernel and which AdamW ran, as recorded, not as configured.

PASS needs every step ok, the resume at the right iteration, timers and trace working, and the
`Requirements`: model-FLOPs utilization at or above its floor, a flash attention kernel (flash or
cuDNN's fused flash attention; never math or the memory-efficient fallback), the fused AdamW
kernel, and TF32 on for fp32 matmuls. A silent fall-back fails the check with a line naming it.
"""
from __future__ import annotations

import glob
import json
import os
import re
import statistics
import sys
from dataclasses import dataclass


# aten ops of F.scaled_dot_product_attention's backends, as the profiler names them
ATTENTION_OPS = {"aten::_scaled_dot_product_flash_attention": "flash",
                 "aten::_scaled_dot_product_flash_attention_for_cpu": "flash",
                 "aten::_scaled_dot_product_cudnn_attention": "cudnn",
                 "aten::_scaled_dot_product_efficient_attention": "efficient",
                 "aten::_efficient_attention_forward": "efficient",
                 "aten::_scaled_dot_product_attention_math": "math"}
FUSED_ADAMW_OPS = ("aten::_fused_adamw_", "aten::_fused_adam_")


@dataclass
class Requirements:
    mfu_floor: float | None = 0.35        # None: not checked (a CPU rehearsal)
    attention: tuple = ("flash", "cudnn")
    fused_adamw: bool = True
    tf32: bool = True


def parse_log(text: str) -> dict:
    """{"iterations": [{"iteration", key: value}], "validation": [(iteration, loss)],
    "parameters_m": float | None, "kernels": {"attention", "optimizer", "fp32 matmul"}} from a
    pretrain log (lines as logger.parse_line reads them)."""
    from megatron_2bw.training.observe.logger import parse_line
    out = {"iterations": [], "validation": [], "parameters_m": None, "kernels": {}}
    for line in text.splitlines():
        m = re.search(r"megatron-2bw: ([\d.]+)M parameters", line)
        if m:
            out["parameters_m"] = float(m.group(1))
        m = re.search(r"megatron-2bw: kernels: attention (\S+), optimizer (\S+), "
                      r"fp32 matmul (\S+)", line)
        if m:
            out["kernels"] = dict(zip(("attention", "optimizer", "fp32 matmul"), m.groups()))
        parsed = parse_line(line)
        if parsed is None:
            continue
        it, fields = parsed
        if "lm loss value" in fields:  # the validation line
            out["validation"].append((it, fields["lm loss value"]))
        else:
            out["iterations"].append({"iteration": it, **fields})
    return out


def profiled_kernels(profile_dir: str) -> dict:
    """{"attention": sorted backends that ran, "fused_adamw": bool, "trace": path | None} from
    the torch.profiler trace(s) in `profile_dir` (--profile's output)."""
    paths = sorted(glob.glob(os.path.join(profile_dir, "*.pt.trace.json")))
    seen, fused = set(), False
    for path in paths:
        with open(path) as fh:
            events = json.load(fh).get("traceEvents", [])
        for e in events:
            name = e.get("name", "")
            if name in ATTENTION_OPS:
                seen.add(ATTENTION_OPS[name])
            fused = fused or name in FUSED_ADAMW_OPS
    return {"attention": sorted(seen), "fused_adamw": fused,
            "trace": paths[0] if paths else None}


def _steady(rows: list, key: str) -> float | None:
    """Median of `key` over the log intervals after the first (which holds the warm-up)."""
    values = [r[key] for r in rows[1:] or rows if isinstance(r.get(key), float)]
    return statistics.median(values) if values else None


def trace_events(prefix: str) -> int:
    """Events in the resume step's trace (PREFIX.rank*.json), each file read and checked as
    tools/plot_schedule.py --trace reads it (pipeline/trace_file.py); 0: none."""
    from megatron_2bw.pipeline.trace_file import read_traces
    files = glob.glob(f"{prefix}.rank*.json") or ([prefix] if os.path.isfile(prefix) else [])
    try:
        return sum(len(t.get("events", [])) for t in read_traces(files, "rerun the check"))
    except SystemExit:
        return 0


def failed_requirements(out: dict, req: Requirements) -> list[str]:
    """One line per requirement the measured run misses (empty: all met)."""
    problems = []
    mfu = out["train"]["mfu"]
    if req.mfu_floor is not None and (mfu is None or mfu < req.mfu_floor):
        problems.append(f"MFU {'n/a' if mfu is None else format(mfu, '.1%')} is below the "
                        f"{req.mfu_floor:.0%} floor (a slow kernel, a wrong --peak-tflops, or "
                        "a busy GPU; --mfu-floor X changes the floor)")
    ran = out["kernels_ran"]["attention"]
    if req.attention and (not ran or not set(ran) <= set(req.attention)):
        problems.append(f"attention ran as {', '.join(ran) or 'nothing recorded'}, not "
                        f"{' or '.join(req.attention)}: scaled_dot_product_attention fell back "
                        "(check the dtype, head size and torch build)")
    if req.fused_adamw and not out["kernels_ran"]["fused_adamw"]:
        problems.append("the fused AdamW kernel (aten::_fused_adamw_) did not run: the "
                        "optimizer fell back to an unfused step (see the kernels: line)")
    if req.tf32 and out["kernels"].get("fp32 matmul") != "tf32":
        problems.append(f"fp32 matmuls run as {out['kernels'].get('fp32 matmul', 'unknown')}, "
                        "not tf32 (was --no-tf32 passed?)")
    return problems


def summarize(s, logs: dict, rcs: dict, peak: float | None, model_gib: dict,
              profile_dir: str | None = None) -> dict:
    """The numbers of the check and its verdicts (see the module doc); `s` is the Settings."""
    train, resume = (parse_log(logs.get(k, "")) for k in ("train", "resume"))
    out = {"mode": "quick" if s.quick else "full",
           "steps": {k: "ok" if rc == 0 else f"failed (exit {rc})" for k, rc in rcs.items()}}
    resumed = [r["iteration"] for r in resume["iterations"]]
    trained = [r["iteration"] for r in train["iterations"]]
    out["resumed_correctly"] = bool(trained and resumed and trained[-1] == s.exit_iters and
                                    resumed[0] == s.exit_iters + s.log_interval and
                                    resumed[-1] == s.train_iters)
    for name, log in (("train", train), ("resume", resume)):
        rate = _steady(log["iterations"], "samples/s")
        tflops = _steady(log["iterations"], "throughput per GPU (TFLOP/s/GPU)")
        out[name] = {"step_time_s": s.global_batch / rate if rate else None,
                     "tokens_per_s": _steady(log["iterations"], "tokens/s"),
                     "tflops_per_gpu": tflops,
                     "mfu": tflops / peak if tflops and peak else None,
                     "peak_memory_gib": max((max(r["memory GB per stage"])
                                             for r in log["iterations"]
                                             if r.get("memory GB per stage")), default=None)}
    rows = resume["iterations"]  # --wall-clock-breakdown: ms per iteration, by interval
    keys = sorted({k for r in rows for k in r if k.startswith("ms ")})
    out["breakdown_ms"] = {k[3:]: sum(r.get(k, 0.0) for r in rows) / len(rows) for k in keys}
    out["trace_events"] = trace_events(os.path.join(s.work_dir, "trace")) if "resume" in logs \
        else 0
    out["kernels"] = train["kernels"]
    out["kernels_ran"] = profiled_kernels(profile_dir) if profile_dir else \
        {"attention": [], "fused_adamw": False, "trace": None}
    out["validation_losses"] = train["validation"] + resume["validation"]
    out["parameters_m"] = train["parameters_m"]
    out["planner_memory_gib"] = model_gib
    out["peak_tflops"] = peak
    out["mfu_floor"] = s.require.mfu_floor
    for k in logs:
        if k.startswith("verify-"):
            out["steps"][k] += "" if "PASS" in logs[k] else " (no PASS)"
    out["problems"] = failed_requirements(out, s.require)
    out["passed"] = (all(v == "ok" for v in out["steps"].values()) and out["resumed_correctly"]
                     and out["trace_events"] > 0 and bool(out["breakdown_ms"])
                     and not out["problems"])
    return out


def report(out: dict, device: str) -> str:
    def f(x, fmt):
        return "n/a" if x is None else format(x, fmt)
    t, r, mem = out["train"], out["resume"], out["planner_memory_gib"]
    k, ran = out["kernels"], out["kernels_ran"]
    floor = "not checked" if out["mfu_floor"] is None else f"floor {out['mfu_floor']:.0%}"
    rows = [f"gpu_check ({out['mode']}) on {device}: peak {f(out['peak_tflops'], 'g')} "
            "TFLOP/s bf16 dense"]
    rows += [f"  {name:<14} {verdict}" for name, verdict in out["steps"].items()]
    rows += [f"  resumed at the right iteration: {'yes' if out['resumed_correctly'] else 'NO'}",
             f"  parameters      {f(out['parameters_m'], '.1f')} M",
             f"  step time       {f(t['step_time_s'], '.3f')} s (train)   "
             f"{f(r['step_time_s'], '.3f')} s (resume, timers + trace on)",
             f"  tokens/s        {f(t['tokens_per_s'], '.4g')}",
             "  resume ms/iter  " + ", ".join(f"{k} {v:.1f}" for k, v in
                                              out["breakdown_ms"].items())
             + f" (--wall-clock-breakdown); --trace: {out['trace_events']} events",
             f"  TFLOP/s per GPU {f(t['tflops_per_gpu'], '.1f')}   MFU {f(t['mfu'], '.1%')} "
             f"({floor})",
             f"  kernels         configured: attention {k.get('attention', '?')}, optimizer "
             f"{k.get('optimizer', '?')}, fp32 matmul {k.get('fp32 matmul', '?')}; profiled: "
             f"attention {', '.join(ran['attention']) or 'none'}, fused AdamW "
             f"{'yes' if ran['fused_adamw'] else 'no'}",
             f"  peak memory     {f(t['peak_memory_gib'], '.2f')} GiB measured   "
             f"{mem['total']:.2f} GiB planner model ("
             + ", ".join(f"{k} {v:.2f}" for k, v in mem.items() if k != "total") + ")",
             "  validation loss " + ", ".join(f"{it}: {v:.3f}"
                                               for it, v in out["validation_losses"])]
    rows += [f"  problem: {p}" for p in out["problems"]]
    rows.append("PASS" if out["passed"] else "FAIL")
    return "\n".join(rows)
