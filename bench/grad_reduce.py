#!/usr/bin/env python
"""The data-parallel reduction in buckets started during the batch's last backward (the default,
pipeline/grad_reduce.py) vs every bucket started after it (--no-overlap-grad-reduce), side by
side on two data-parallel ranks.

    python bench/grad_reduce.py                      # both shapes, every schedule, 7 rounds
    python bench/grad_reduce.py --shapes small --repeats 9 --json gr.json

Shapes (GPT, d=1, w=2: two spawned processes, one thread each, gloo, mock data, Adam, fp32):
    default  4 layers, hidden 256, seq 64, micro batch 4, m 4, buckets of 400k parameters (~9)
    small    2 layers, hidden 64, seq 32, micro batch 1, m 4, buckets of 20k (~8): tiny
             microbatches, where the hooks' Python work weighs most

Both modes' engines are built once in the same two processes and timed `--batches` batches at a
time, interleaved and rotated, for `--repeats` rounds (every rank runs the same order); the table
shows median samples/s, the paired ratio early/at-R (median of per-round ratios, 95% interval)
and whether the losses are bitwise equal (they must be at w=2: the same sums, only earlier).
On this CPU the reduction is gloo's on the same two cores the backward uses, so what overlap can
win is the wait, not the work; on a GPU cluster the reduction runs on the network.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import _rounds as R  # noqa: E402
import overhead  # noqa: E402
from megatron_2bw.schedule.kinds import schedule_names  # noqa: E402

SHAPES = {"default": dict(layers=4, hidden=256, heads=4, seq=64, vocab=2048, micro=4, m=4,
                          bucket=400_000),
          "small": dict(layers=2, hidden=64, heads=4, seq=32, vocab=2048, micro=1, m=4,
                        bucket=20_000)}
MODES = ("early", "at-R")
SCHEDULES = schedule_names()


def make_config(spec: dict, schedule: str, mode: str):
    return overhead.make_config(spec, schedule, data=2, grad_bucket_size=spec["bucket"],
                                overlap_grad_reduce=mode == "early")


def run(rank, world, spec, names):
    from megatron_2bw.parallel.grid import ProcessGrid
    from megatron_2bw.training.build import build_engine, mock_batches
    C.framework_warmup()
    grid, runners, buckets = None, {}, {}
    for n in names:
        cfg = make_config(spec, *n.split(":"))
        grid = grid or ProcessGrid.from_config(cfg, rank, world).init_groups()
        engine = build_engine(cfg, grid, "cpu")
        runners[n] = (engine, mock_batches(cfg, 2, grid.dp_rank))
    times, losses = overhead.timed_rounds(runners, names, spec)
    for n, (engine, _) in runners.items():
        r = engine.stepper.reduction
        buckets[n] = {"buckets": len(r.buckets), "early": r.early_buckets}
    return {"times": times, "losses": losses, "buckets": buckets}


def summarize(spec: dict, res: dict) -> dict:
    out = R.samples_per_s(res["times"], spec["micro"] * spec["m"] * 2 * spec["batches"])
    rows = []
    for s in SCHEDULES:
        a, b = f"{s}:early", f"{s}:at-R"
        rows.append({"schedule": s, "early": out[a]["samples_per_s"],
                     "at_r": out[b]["samples_per_s"], **R.paired_row(out, res["losses"], a, b),
                     "buckets": res["buckets"][a]["buckets"],
                     "started_early": res["buckets"][a]["early"]})
    return {"spec": spec, "rows": rows}


def format_summary(name: str, summary: dict) -> str:
    spec = summary["spec"]
    rows = [[r["schedule"], f"{r['early']:.2f}", f"{r['at_r']:.2f}",
             C.with_interval(r["ratio"], r["interval"]),
             f"{r['buckets']} ({r['started_early']} early)",
             "bitwise equal" if r["losses_equal"] else "DIFFER"] for r in summary["rows"]]
    return "\n".join([
        f"{name}: GPT layers={spec['layers']} hidden={spec['hidden']} seq={spec['seq']} "
        f"micro-batch={spec['micro']} m={spec['m']} fp32, d=1 w=2, buckets of "
        f"{spec['bucket']}; {spec['repeats']} interleaved rounds of {spec['batches']} batches",
        C.table(["schedule", "early samples/s", "at-R samples/s", "early / at-R (paired)",
                 "buckets", "losses"], rows)])


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    R.add_round_args(p, SHAPES)
    p.add_argument("--bucket", type=int, default=None,
                   help="parameters per bucket for every shape (default: the shape's; "
                        "40000000 is Megatron's default at w=2: one bucket here)")
    args = p.parse_args(argv)
    args.shape_names = R.chosen(p, args.shapes, SHAPES, "shape")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    names = [f"{s}:{mode}" for s in SCHEDULES for mode in MODES]

    def measure(shape, spec):
        spec["bucket"] = args.bucket or spec["bucket"]
        summary = summarize(spec, C.run_spawned(run, 2, (spec, names), timeout=args.timeout)[0])
        ok = all(r["losses_equal"] and r["started_early"] > 0 for r in summary["rows"])
        return summary, format_summary(shape, summary), ok

    rc = R.run_shapes("bench/grad_reduce.py", args, SHAPES,
                      dict(layers=1, hidden=16, heads=2, seq=8, vocab=64, m=2, bucket=300),
                      measure)
    if rc:
        print("FAILED: the modes' losses differ, or no bucket started early", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
