#!/usr/bin/env python
"""bf16 training with --grad-accumulation fp32 (the default: each parameter's gradient added into
the fp32 buffer by its post-accumulate hook, Megatron's main_grad) vs --grad-accumulation buffer
(a stage-sized bf16 gradient folded into fp32 by one flat add per microbatch), side by side.

    python bench/grad_accumulation.py                  # both shapes, every schedule, 7 rounds
    python bench/grad_accumulation.py --shapes small --repeats 9 --json ga.json

Shapes (GPT, d=1, one spawned process, one thread, mock data, Adam, clipping at 1.0):
    default  4 layers, hidden 256, seq 64, micro batch 4, m 8 (bench/overhead.py's)
    small    2 layers, hidden 64, seq 32, micro batch 1, m 8: tiny microbatches, where one hook
             call per parameter and microbatch weighs most against the one flat add

For each shape the engines of every (schedule, mode) are built once and timed `--batches`
batches at a time, interleaved and rotated, for `--repeats` rounds; the table shows median
samples/s and the paired ratio fp32/buffer (median of the per-round ratios, with its 95%
interval). Both modes give bitwise the same losses (checked on every batch: the numbers do not
depend on the mode, only the memory: 2 bytes per parameter more for the buffer).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import _rounds as R  # noqa: E402
from overhead import make_config, timed_rounds  # noqa: E402
from megatron_2bw.schedule.kinds import schedule_names  # noqa: E402

SHAPES = {"default": dict(layers=4, hidden=256, heads=4, seq=64, vocab=2048, micro=4, m=8),
          "small": dict(layers=2, hidden=64, heads=4, seq=32, vocab=2048, micro=1, m=8)}
MODES = ("fp32", "buffer")


def _engine(spec: dict, schedule: str, mode: str):
    from megatron_2bw.parallel.grid import ProcessGrid
    from megatron_2bw.training.build import build_engine, mock_batches
    cfg = make_config(spec, schedule)
    cfg = cfg.replace(precision={"dtype": "bf16", "grad_accumulation": mode}).validate(1)
    return build_engine(cfg, ProcessGrid(1, 1, 1, rank=0), "cpu"), mock_batches(cfg, 1, 0)


def run(rank, world, spec, names):
    C.framework_warmup()
    runners = {n: _engine(spec, *n.split(":")) for n in names}
    times, losses = timed_rounds(runners, names, spec)
    return {"times": times, "losses": losses}


def summarize(spec: dict, res: dict, schedules) -> dict:
    out = R.samples_per_s(res["times"], spec["micro"] * spec["m"] * spec["batches"])
    rows = []
    for s in schedules:
        a, b = f"{s}:fp32", f"{s}:buffer"
        rows.append({"schedule": s, "fp32": out[a]["samples_per_s"],
                     "buffer": out[b]["samples_per_s"], **R.paired_row(out, res["losses"], a, b)})
    return {"spec": spec, "rows": rows}


def format_summary(name: str, summary: dict) -> str:
    spec = summary["spec"]
    rows = [[r["schedule"], f"{r['fp32']:.2f}", f"{r['buffer']:.2f}",
             C.with_interval(r["ratio"], r["interval"]),
             "bitwise equal" if r["losses_equal"] else "DIFFER"] for r in summary["rows"]]
    return "\n".join([
        f"{name}: GPT layers={spec['layers']} hidden={spec['hidden']} seq={spec['seq']} "
        f"micro-batch={spec['micro']} m={spec['m']} bf16, d=1, 1 thread; {spec['repeats']} "
        f"interleaved rounds of {spec['batches']} batches",
        C.table(["schedule", "fp32 samples/s", "buffer samples/s", "fp32 / buffer (paired)",
                 "losses"], rows)])


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    R.add_round_args(p, SHAPES)
    p.add_argument("--schedules", default=",".join(schedule_names()))
    args = p.parse_args(argv)
    args.shape_names = R.chosen(p, args.shapes, SHAPES, "shape")
    args.schedule_names = R.chosen(p, args.schedules, schedule_names(), "schedule")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    names = [f"{s}:{mode}" for s in args.schedule_names for mode in MODES]

    def measure(shape, spec):
        res = C.run_spawned(run, 1, (spec, names), timeout=args.timeout)[0]
        summary = summarize(spec, res, args.schedule_names)
        ok = all(r["losses_equal"] for r in summary["rows"])
        return summary, format_summary(shape, summary), ok

    return R.run_shapes("bench/grad_accumulation.py", args, SHAPES,
                        dict(layers=1, hidden=16, heads=2, seq=8, vocab=64, m=2), measure)


if __name__ == "__main__":
    sys.exit(main())
