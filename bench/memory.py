#!/usr/bin/env python
"""Memory per pipeline stage for gpipe / flush / 2bw at several m: measured vs the planner's model.

    python bench/memory.py                               # GPT, d=2, m = 2 4 8 16
    python bench/memory.py --num-microbatches 4,8 --json memory.json
    python bench/memory.py --schedules 2bw -m 4 --data-parallel-size 4 --bf16 \
        --distributed-optimizer both                     # bytes per parameter, w=4, ZeRO-1 or not

For every (schedule, m, distributed optimizer) it trains a small GPT (megatron_2bw.models.gpt,
mock data, Adam) on d x w fresh gloo processes for a few batches and reports, per stage:

- the engine's own buffers: weight versions (`engine.weights.slots`), fp32 gradient buffers
  (one per version slot; `--2bw-grad-buffers 1`: one per 2bw stage and each slot's loss), the
  low-precision gradient buffer (bf16/fp16 with --grad-accumulation buffer; the default fp32
  accumulation has none) and master weights (bf16/fp16),
  optimizer state (the flat optimizer's, or every piece's of the distributed optimizer), and the
  same in bytes per parameter of the stage;
- the peak activation stash: the bytes autograd saves for the backward during each forward
  (counted with `torch.autograd.graph.saved_tensors_hooks` in a `PipelineEngine` subclass,
  unique storages, parameters excluded) plus the received input and the stage output kept per
  in-flight microbatch, summed over the microbatches in flight, and the peak count of those;
- the process's peak RSS above its RSS after imports and data;
- the planner's prediction for the same layout (`planner.cost_model`: state_bytes with the
  schedule kind's num_slots and the distributed optimizer's shards, activation_bytes x the kind's
  in_flight), and measured / predicted.

A run is a schedule, optionally with a 2BW compensation after a `+` (`--schedules 2bw,2bw+predict`:
fp32 `predict` keeps the real weights in one more stage-sized buffer, the `master` column;
`predict-nesterov`'s optimizer also keeps the latest gradient, one more in the `optimizer` one).

Targets (reported, not asserted): 2BW's stage-0 stash peaks at <= d microbatches; 2BW's stage
memory (buffers + stash) <= 0.6 x GPipe's at m = 8 without recomputation; with the distributed
optimizer, master weights plus optimizer state per rank are 1/w of the run without it (up to the
padding to a multiple of w) and equal the memory model's bytes exactly.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
from memory_report import STATE, format_rows, targets  # noqa: E402
from megatron_2bw.config.choices import GRAD_ACCUMULATIONS
from megatron_2bw.config.schedule_flags import grad_buffers_arg
from megatron_2bw.schedule.compensation_methods import NONE, compensation_error, method_names
from megatron_2bw.schedule.kinds import (schedule_kind, schedule_kind_of,  # noqa: E402
                                         schedule_names)

SCHEDULES = schedule_names()
COMPENSATIONS = [m for m in method_names() if m != NONE]


def split_run(run: str) -> tuple[str, str]:
    """"2bw+predict" -> ("2bw", "predict"); "gpipe" -> ("gpipe", "none")."""
    schedule, _, method = run.partition("+")
    return schedule, method or NONE


def make_config(spec: dict, run: str, m: int, dist: bool = False):
    from megatron_2bw.config import (BatchConfig, Config, ModelConfig, OptimizerConfig,
                                     ParallelConfig, PrecisionConfig, TrainConfig)
    b, d, w = spec["micro"], spec["d"], spec["w"]
    model = ModelConfig(num_layers=spec["layers"], hidden_size=spec["hidden"],
                        num_attention_heads=spec["heads"], seq_length=spec["seq"],
                        vocab_size=spec["vocab"], init_method_std=0.02,
                        recompute_method="uniform" if spec["recompute"] else None,
                        recompute_num_layers=1 if spec["recompute"] else 0)
    schedule, compensation = split_run(run)
    return Config(model=model, schedule=schedule, compensation=compensation,
                  grad_buffers=grad_buffers(spec, schedule),
                  parallel=ParallelConfig(pipeline=d, data=w, distributed_optimizer=dist),
                  batch=BatchConfig(micro_batch_size=b, global_batch_size=b * m * w),
                  optimizer=OptimizerConfig(lr=1e-4),
                  precision=PrecisionConfig(spec["dtype"], grad_accumulation=spec["accumulate"]),
                  train=TrainConfig(train_iters=spec["batches"], seed=1234)).validate(d * w)


def grad_buffers(spec: dict, schedule: str):
    """--2bw-grad-buffers for the runs whose kind has that mode (the others keep theirs)."""
    g = spec.get("grad_buffers")
    return g if g in schedule_kind(schedule).grad_buffers_choices else None


def metered_engine_class():
    """PipelineEngine + stash accounting (the engine itself is not modified)."""
    import torch
    from megatron_2bw.pipeline.engine import PipelineEngine

    class MeteredEngine(PipelineEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._own = {t.untyped_storage().data_ptr() for t in
                         list(self.weights.slots) + self.weights.held_grads() +
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


def optimizer_buffers(optimizer) -> list:
    """The state tensors an optimizer allocated: the flat optimizer's, or every piece's inner
    optimizer's with the distributed optimizer (padding included: what the memory holds)."""
    import torch
    inner = getattr(optimizer, "inner", [optimizer])
    return [v for opt in inner for v in opt.state_dict().values() if isinstance(v, torch.Tensor)]


def run_stage(rank, world, spec, schedule, m, dist):
    from megatron_2bw.parallel.grid import ProcessGrid
    from megatron_2bw.tensor_parallel import TPGroup
    from megatron_2bw.training.build import mock_batches
    from megatron_2bw.models.families import model_parts
    cfg = make_config(spec, schedule, m, dist)
    grid = ProcessGrid.from_config(cfg, rank, world).init_groups()
    data = list(_take(mock_batches(cfg, grid.data, grid.dp_rank), (spec["batches"] + 1) * m))
    C.framework_warmup()
    probe = C.MemoryProbe()
    specs, loss_fn, bounds = model_parts(cfg, TPGroup.from_grid(grid), grid.pipeline)
    engine = metered_engine_class()(cfg, grid, specs, loss_fn, bounds, "cpu")
    it = iter(data)
    for _ in range(spec["batches"]):
        engine.train_batch(it)
    w, s = engine.weights, grid.stage
    return {"stage": s, "dp": grid.dp_rank, "bounds": bounds[s:s + 2],
            "params": w.layout.real_numel, "versions": w.num_slots,
            "weights": _nbytes(w.slots), "master": _nbytes([w.master]),
            "grads": _nbytes(w.held_grads()), "model_grad": _nbytes([w.model_grad]),
            "optimizer": _nbytes(optimizer_buffers(engine.optimizer)),
            "stash_peak": engine.peak_bytes, "in_flight_peak": engine.peak_count,
            "stash_per_microbatch": max(engine.per_microbatch) if engine.per_microbatch else 0,
            "memory": probe.result()}


def _take(it, n):
    for _ in range(n):
        yield next(it)




def predict(spec: dict, schedule: str, m: int, stage: int, bounds: list, dist: bool) -> dict:
    """The planner's memory model for this stage (planner/cost_model.py)."""
    from megatron_2bw.models.flops import layer_costs
    from megatron_2bw.planner.cost_model import (activation_bytes, stage_params, stage_tied,
                                                 state_bytes)
    cfg = make_config(spec, schedule, m, dist)
    kind = schedule_kind_of(cfg.schedule, cfg.grad_buffers)
    costs = layer_costs(cfg.model, spec["micro"], 1, spec["dtype"], "gpt")
    lo, hi = bounds
    params = stage_params(costs, lo, hi)
    mem = state_bytes(params, kind.num_slots, spec["dtype"], "adam",
                      spec["w"] if dist else 1, stage_tied(costs, lo, hi, spec["d"]),
                      cfg.compensation, kind.grad_buffers_of(stage), spec["accumulate"])
    mem["params"] = params
    per_mb, extra = activation_bytes(costs, lo, hi, spec["recompute"], stage == spec["d"] - 1)
    peak = kind.in_flight(spec["d"], m, stage)
    mem["stash"] = peak * per_mb + extra
    mem["in_flight"] = peak
    mem["stash_per_microbatch"] = per_mb
    mem["total"] = sum(v for k, v in mem.items() if k in STATE + ("stash",))
    return mem


def measure(spec: dict, schedules, ms, timeout=600, log=print, dists=(False,)) -> list:
    rows = []
    for m in ms:
        for schedule in schedules:
            error = schedule_kind(split_run(schedule)[0]).microbatch_error(spec["d"], m,
                                                                           "skipped")
            if error:
                log(f"  {error}")
                continue
            for dist in dists:
                name = f"{schedule} m={m}{' distributed optimizer' if dist else ''}"
                row = {"schedule": schedule, "m": m, "distributed_optimizer": dist}
                try:
                    res = C.run_spawned(
                        functools.partial(run_stage, schedule=schedule, m=m, dist=dist),
                        spec["d"] * spec["w"], (spec,), timeout=timeout)
                except C.RunError as e:
                    log(f"  {name}: FAILED {e}")
                    rows.append(dict(row, error=str(e)))
                    continue
                for r in res:
                    r["total"] = sum(r[k] for k in STATE) + r["stash_peak"]
                    r["model"] = predict(spec, schedule, m, r["stage"], r["bounds"], dist)
                # every data-parallel rank of a stage holds the same buffers; report replica 0
                rows.append(dict(row, stages=sorted((r for r in res if r["dp"] == 0),
                                                    key=lambda r: r["stage"]),
                                 replicas_alike=all(
                                     all(r[k] == q[k] for k in STATE)
                                     for r in res for q in res if q["stage"] == r["stage"])))
                log(f"  {name}: done")
    return rows


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
    p.add_argument("--data-parallel-size", "-w", type=int, default=1)
    p.add_argument("--2bw-grad-buffers", dest="grad_buffers", type=grad_buffers_arg,
                   choices=(1, 2, "first"), default=None,
                   help="fp32 gradient buffers per stage of the 2bw runs (default: one per "
                        "weight version; first: one on stage 0, two on the others)")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--grad-accumulation", choices=GRAD_ACCUMULATIONS, default="fp32",
                   help="bf16/fp16: the engine's --grad-accumulation (buffer: + a bf16 gradient)")
    p.add_argument("--distributed-optimizer", choices=("off", "on", "both"), default="off",
                   help="both: every run with and without --use-distributed-optimizer")
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
    if args.bf16 and args.fp16:
        p.error("--bf16 and --fp16 exclude each other: pick one")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    spec = dict(d=args.pipeline_stages, layers=args.num_layers, hidden=args.hidden_size,
                heads=args.num_attention_heads, seq=args.seq_length, vocab=args.vocab_size,
                micro=args.micro_batch_size, batches=args.batches, recompute=args.recompute,
                w=args.data_parallel_size, grad_buffers=args.grad_buffers,
                accumulate=args.grad_accumulation if (args.bf16 or args.fp16) else "fp32",
                dtype="bf16" if args.bf16 else ("fp16" if args.fp16 else "fp32"))
    ms = args.ms
    if args.tiny:
        spec.update(layers=2, hidden=16, heads=2, seq=8, vocab=64, micro=2, batches=2)
        ms = [2]
    dists = {"off": (False,), "on": (True,), "both": (False, True)}[args.distributed_optimizer]
    print(f"# bench/memory.py  {C.stamp()}\n# {C.command_line()}", flush=True)
    rows = measure(spec, args.scheds, ms, args.timeout,
                   log=lambda s: print(s, file=sys.stderr, flush=True), dists=dists)
    print(format_rows(spec, rows), flush=True)
    if args.json:
        C.write_json(args.json, {"date": C.stamp(), "command": C.command_line(), "spec": spec,
                                 "rows": rows,
                                 "targets": [list(t) for t in targets(spec, rows)]})
    return 0 if all("stages" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
