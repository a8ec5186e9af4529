#!/usr/bin/env python
"""Memory per pipeline stage for gpipe / flush / 2bw at several m: measured vs the planner's model.

    python bench/memory.py                               # GPT, d=2, m = 2 4 8 16
    python bench/memory.py --num-microbatches 4,8 --json memory.json

For every (schedule, m) it trains a small GPT (megatron_2bw.models.gpt, mock data, fp32, Adam) on
d fresh gloo processes for a few batches and reports, per stage:

- the engine's own buffers: weight versions (`engine.weights.slots`), fp32 gradient buffers
  (one per version slot), master weights (bf16/fp16 only), optimizer state
  (`engine.stepper.optimizer.state_dict()`);
- the peak activation stash: the bytes autograd saves for the backward during each forward
  (counted with `torch.autograd.graph.saved_tensors_hooks` in a `PipelineEngine` subclass,
  unique storages, parameters excluded) plus the received input and the stage output kept per
  in-flight microbatch, summed over the microbatches in flight, and the peak count of those;
- the process's peak RSS above its RSS after imports and data;
- the planner's prediction for the same layout (`planner.cost_model`: state_bytes with the
  schedule kind's num_slots, activation_bytes x the kind's in_flight), and measured / predicted.

A run is a schedule, optionally with a 2BW compensation after a `+` (`--schedules 2bw,2bw+predict`:
fp32 `predict` keeps the real weights in one more stage-sized buffer, the `master` column).

Targets (reported, not asserted): 2BW's stage-0 stash peaks at <= d microbatches; 2BW's stage
memory (buffers + stash) <= 0.6 x GPipe's at m = 8 without recomputation.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
from megatron_2bw.pipeline.compensation import (NONE, compensation_error,  # noqa: E402
                                                method_names)
from megatron_2bw.pipeline.registry import schedule_kind, schedule_names  # noqa: E402

SCHEDULES = schedule_names()
COMPENSATIONS = [m for m in method_names() if m != NONE]
SUBJECT = "2bw"     # the targets are about this schedule
BASELINE = "gpipe"  # ... compared with this one


def split_run(run: str) -> tuple[str, str]:
    """"2bw+predict" -> ("2bw", "predict"); "gpipe" -> ("gpipe", "none")."""
    schedule, _, method = run.partition("+")
    return schedule, method or NONE


def make_config(spec: dict, run: str, m: int):
    from megatron_2bw.config import (BatchConfig, Config, ModelConfig, OptimizerConfig,
                                     ParallelConfig, TrainConfig)
    b = spec["micro"]
    model = ModelConfig(num_layers=spec["layers"], hidden_size=spec["hidden"],
                        num_attention_heads=spec["heads"], seq_length=spec["seq"],
                        vocab_size=spec["vocab"], init_method_std=0.02,
                        recompute_method="uniform" if spec["recompute"] else None,
                        recompute_num_layers=1 if spec["recompute"] else 0)
    schedule, compensation = split_run(run)
    return Config(model=model, schedule=schedule, compensation=compensation,
                  parallel=ParallelConfig(pipeline=spec["d"]),
                  batch=BatchConfig(micro_batch_size=b, global_batch_size=b * m),
                  optimizer=OptimizerConfig(lr=1e-4),
                  train=TrainConfig(train_iters=spec["batches"], seed=1234)).validate(spec["d"])


def metered_engine_class():
    """PipelineEngine + stash accounting (the engine itself is not modified)."""
    import torch
    from megatron_2bw.pipeline.engine import PipelineEngine

    class MeteredEngine(PipelineEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._own = {t.untyped_storage().data_ptr() for t in
                         list(self.weights.slots) + list(self.weights.grads) +
                         [x for x in (self.weights.master, self.weights.model_grad)
                          if x is not None]}
            self.live: dict[int, int] = {}
            self.peak_bytes = self.peak_count = 0
            self.per_microbatch: list[int] = []

        def _forward(self, a):
            seen: dict[int, int] = {}

            def pack(t):
                st = t.untyped_storage()
                if st.data_ptr() not in self._own:
                    seen[st.data_ptr()] = st.nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                super()._forward(a)
            kept = list(self.inputs.get(a.mb, ()))
            out = self.outputs.get(a.mb)
            kept += list(out) if isinstance(out, tuple) else [out]
            for t in kept:
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    seen.setdefault(st.data_ptr(), st.nbytes())
            size = sum(seen.values())
            self.live[a.mb] = size
            self.per_microbatch.append(size)
            self.peak_bytes = max(self.peak_bytes, sum(self.live.values()))
            self.peak_count = max(self.peak_count, len(self.live))

        def _backward(self, a):
            super()._backward(a)
            self.live.pop(a.mb, None)

    return MeteredEngine


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def run_stage(rank, world, spec, schedule, m):
    import torch
    from megatron_2bw.parallel.grid import ProcessGrid
    from megatron_2bw.tensor_parallel import TPGroup
    from megatron_2bw.training import mock_batches, model_parts
    cfg = make_config(spec, schedule, m)
    data = list(_take(mock_batches(cfg, 1, 0), (spec["batches"] + 1) * m))
    C.framework_warmup()
    probe = C.MemoryProbe()
    grid = ProcessGrid(1, world, 1, rank=rank).init_groups()
    specs, loss_fn, bounds = model_parts(cfg, TPGroup.from_grid(grid), grid.pipeline)
    engine = metered_engine_class()(cfg, grid, specs, loss_fn, bounds, "cpu")
    it = iter(data)
    for _ in range(spec["batches"]):
        engine.train_batch(it)
    w = engine.weights
    opt = [v for v in engine.stepper.optimizer.state_dict().values()
           if isinstance(v, torch.Tensor)]
    return {"stage": rank, "bounds": bounds[rank:rank + 2], "params": w.numel,
            "versions": w.num_slots,
            "weights": _nbytes(w.slots), "master": _nbytes([w.master]),
            "grads": _nbytes(w.grads) + _nbytes([w.model_grad]), "optimizer": _nbytes(opt),
            "stash_peak": engine.peak_bytes, "in_flight_peak": engine.peak_count,
            "stash_per_microbatch": max(engine.per_microbatch) if engine.per_microbatch else 0,
            "memory": probe.result()}


def _take(it, n):
    for _ in range(n):
        yield next(it)


def predict(spec: dict, schedule: str, m: int, stage: int, bounds: list) -> dict:
    """The planner's memory model for this stage (planner/cost_model.py)."""
    from megatron_2bw.models.flops import layer_costs
    from megatron_2bw.planner.cost_model import activation_bytes, stage_params, state_bytes
    cfg = make_config(spec, schedule, m)
    kind = schedule_kind(cfg.schedule)
    costs = layer_costs(cfg.model, spec["micro"], 1, "fp32", "gpt")
    lo, hi = bounds
    params = stage_params(costs, lo, hi)
    mem = state_bytes(params, kind.num_slots, "fp32", "adam", cfg.compensation)
    per_mb, extra = activation_bytes(costs, lo, hi, spec["recompute"], stage == spec["d"] - 1)
    peak = kind.in_flight(spec["d"], m, stage)
    mem["stash"] = peak * per_mb + extra
    mem["in_flight"] = peak
    mem["stash_per_microbatch"] = per_mb
    mem["total"] = sum(v for k, v in mem.items()
                       if k in ("weights", "master", "grads", "model_grad", "optimizer", "stash"))
    return mem


def measure(spec: dict, schedules, ms, timeout=600, log=print) -> list:
    rows = []
    for m in ms:
        for schedule in schedules:
            error = schedule_kind(split_run(schedule)[0]).microbatch_error(spec["d"], m,
                                                                           "skipped")
            if error:
                log(f"  {error}")
                continue
            try:
                res = C.run_spawned(functools.partial(run_stage, schedule=schedule, m=m),
                                    spec["d"], (spec,), timeout=timeout)
            except C.RunError as e:
                log(f"  {schedule} m={m}: FAILED {e}")
                rows.append({"schedule": schedule, "m": m, "error": str(e)})
                continue
            for r in res:
                r["total"] = r["weights"] + r["master"] + r["grads"] + r["optimizer"] + \
                    r["stash_peak"]
                r["model"] = predict(spec, schedule, m, r["stage"], r["bounds"])
            rows.append({"schedule": schedule, "m": m, "stages": res})
            log(f"  {schedule} m={m}: done")
    return rows


def targets(spec: dict, rows: list) -> list:
    d = spec["d"]
    by = {(r["schedule"], r["m"]): r for r in rows if "stages" in r}
    res = []
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


def format_rows(spec: dict, rows: list) -> str:
    headers = ["schedule", "m", "stage", "versions", "weights", "master", "grads", "optimizer",
               "stash peak (mb)", "total", "model total", "meas/model", "peak RSS+"]
    out = []
    for r in rows:
        if "stages" not in r:
            out.append([r["schedule"], r["m"], "-", r["error"]] + ["-"] * 9)
            continue
        for s in r["stages"]:
            mdl = s["model"]
            out.append([r["schedule"], r["m"], s["stage"], s["versions"], C.mb(s["weights"]),
                        C.mb(s["master"]), C.mb(s["grads"]), C.mb(s["optimizer"]),
                        f"{C.mb(s['stash_peak'])} ({s['in_flight_peak']})", C.mb(s["total"]),
                        f"{C.mb(mdl['total'])} ({mdl['in_flight']})",
                        f"{s['total'] / mdl['total']:.2f}" if mdl["total"] else "-",
                        C.mb(s["memory"]["peak_above_baseline"])])
    text = [f"GPT layers={spec['layers']} hidden={spec['hidden']} heads={spec['heads']} "
            f"seq={spec['seq']} vocab={spec['vocab']} micro-batch={spec['micro']} d={spec['d']} "
            f"fp32 Adam{' recompute' if spec['recompute'] else ''}; MB = 2^20 bytes",
            C.table(headers, out),
            "stash peak (mb): peak bytes saved for backward + kept inputs/outputs over the "
            "microbatches in flight (their peak count); model total (in flight): the planner's "
            "state_bytes + activation_bytes x in_flight; peak RSS+: process peak RSS above its "
            "RSS after imports and data"]
    for name, value, met in targets(spec, rows):
        text.append(f"target: {name}: {value} -> {'met' if met else 'MISSED'}")
    return "\n".join(text)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pipeline-stages", "-d", type=int, default=2)
    p.add_argument("--num-microbatches", "-m", default="2,4,8,16",
                   help="comma-separated list of m")
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--batches", type=int, default=3, help="batches trained per run")
    p.add_argument("--recompute", action="store_true", help="recompute transformer layers")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", default=None)
    p.add_argument("--tiny", action="store_true", help="a seconds-long smoke run (tests)")
    args = p.parse_args(argv)
    args.ms = [int(x) for x in args.num_microbatches.split(",") if x.strip()]
    args.scheds = [s.strip() for s in args.schedules.split(",") if s.strip()]
    bad = [s for s in args.scheds if split_run(s)[0] not in SCHEDULES
           or compensation_error(split_run(s)[1], split_run(s)[0], "adam", 0.9)]
    if bad:
        p.error(f"unknown schedule(s) {', '.join(bad)}: use {', '.join(SCHEDULES)}, 2BW "
                f"with a compensation after '+' ({', '.join(COMPENSATIONS)})")
    if args.num_layers < args.pipeline_stages:
        p.error("--num-layers must be >= --pipeline-stages")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    spec = dict(d=args.pipeline_stages, layers=args.num_layers, hidden=args.hidden_size,
                heads=args.num_attention_heads, seq=args.seq_length, vocab=args.vocab_size,
                micro=args.micro_batch_size, batches=args.batches, recompute=args.recompute)
    ms = args.ms
    if args.tiny:
        spec.update(layers=2, hidden=16, heads=2, seq=8, vocab=64, micro=2, batches=2)
        ms = [2]
    print(f"# bench/memory.py  {C.stamp()}\n# {C.command_line()}", flush=True)
    rows = measure(spec, args.scheds, ms, args.timeout,
                   log=lambda s: print(s, file=sys.stderr, flush=True))
    print(format_rows(spec, rows), flush=True)
    if args.json:
        C.write_json(args.json, {"date": C.stamp(), "command": C.command_line(), "spec": spec,
                                 "rows": rows,
                                 "targets": [list(t) for t in targets(spec, rows)]})
    return 0 if all("stages" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
