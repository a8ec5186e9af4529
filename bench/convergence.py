#!/usr/bin/env python
"""2BW's convergence at length, every method against GPipe: `tools/compare_convergence.py` over
models x settings x seeds, one cell (model, setting, seed) per output directory, and one table.

    python bench/convergence.py                                  # the full grid: 1000 iterations
    python bench/convergence.py --models gpt --seeds 1234 --train-iters 300
    python bench/convergence.py --report-only --out-dir bench/results/convergence_1000it

Each cell runs gpipe, plain 2bw and 2bw with each compensation (`2bw+M`) through the real
training code (compare_convergence: same seed, data order and lr schedule; the same held-out
validation batches at every point). The settings:

- `default`: compare_convergence's defaults (lr 1e-3, warm-up 10%, cosine to 1e-4, Adam beta2
  0.95), the usual GPT pretraining optimizer;
- `lr3e-3`: a constant lr 3e-3, no warm-up, Adam beta2 0.999 (where plain 2BW's staleness costs
  most).

Reported per cell and run: the final validation loss relative to gpipe's, and the iterations to
reach gpipe's final validation loss (the first validation point at or below it; iterations, not
seconds: losses do not depend on the machine's load, seconds do). The `auto` column is the method
`--2bw-compensation auto` picks for this optimizer and precision (`auto_method`), read off the
run of that method: auto *is* that method (tests/distributed/test_compensation_auto.py checks
that the two train bitwise alike).

A cell whose summary.json exists is not run again (an interrupted grid continues where it
stopped); `--report-only` prints the table of what exists. The table is markdown, for
bench/README.md; `--json` writes the numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from megatron_2bw.cli import compare_convergence  # noqa: E402
from megatron_2bw.cli.convergence_report import BASELINE  # noqa: E402
from megatron_2bw.schedule.compensation_methods import NONE, method_names  # noqa: E402
from megatron_2bw.schedule.kinds import schedule_kind, schedule_names  # noqa: E402

SETTINGS = {
    "default": [],
    "lr3e-3": ["--lr", "3e-3", "--lr-decay-style", "constant", "--lr-warmup-iters", "0",
               "--adam-beta2", "0.999"],
}
METHODS = [m for m in method_names() if m not in (NONE, "auto")]


STALE = [s for s in schedule_names() if schedule_kind(s).delay == 1]  # what compensation is for


def compared() -> list[str]:
    """The runs compared with the baseline: each one-step-stale schedule, plain and with each
    compensation."""
    return [run for s in STALE for run in [s] + [f"{s}+{m}" for m in METHODS]]


def runs() -> list[str]:
    return [BASELINE] + compared()


def cell_dir(out: str, model: str, setting: str, seed: int) -> str:
    return os.path.join(out, f"{model}_{setting}_seed{seed}")


def run_cell(out: str, model: str, setting: str, seed: int, iters: int, eval_interval: int
             ) -> None:
    where = cell_dir(out, model, setting, seed)
    if os.path.exists(os.path.join(where, "summary.json")):
        print(f"# {where}: done already", flush=True)
        return
    argv = ["--model-type", model, "--schedules", ",".join(runs()), "--train-iters", str(iters),
            "--eval-interval", str(eval_interval), "--out-dir", where, "--"] + \
        SETTINGS[setting] + ["--seed", str(seed)]
    started = time.time()
    print(f"# {time.strftime('%H:%M:%S')} {where}: compare_convergence {' '.join(argv)}",
          flush=True)
    status = compare_convergence.main(argv)
    print(f"# {where}: {time.time() - started:.0f} s, exit {status}, load "
          f"{os.getloadavg()[0]:.1f}", flush=True)


def auto_method(model: str) -> str:
    """What --2bw-compensation auto picks for this bench's optimizer (Adam, fp32)."""
    try:
        from megatron_2bw.schedule.compensation_methods import auto_method as pick
    except ImportError:  # before auto existed
        return "?"
    return pick("adam", 0.9, "fp32")


def _pct(rel) -> str:
    return "-" if rel is None else f"{100 * rel:+.2f}%"


def report(out: str, models, settings, seeds) -> tuple[str, dict]:
    cols = compared()
    head = ("| model | setting | seed | gpipe val loss | iters to it | "
            + " | ".join(f"{c} | iters" for c in cols) + " | auto |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    numbers = {}
    for model in models:
        auto = auto_method(model)
        for setting in settings:
            for seed in seeds:
                path = os.path.join(cell_dir(out, model, setting, seed), "summary.json")
                if not os.path.exists(path):
                    continue
                with open(path) as f:
                    s = json.load(f)
                rel = s["validation_rel_diff_vs_gpipe"]
                reach = s["to_target"]
                its = {r: (None if reach.get(r) is None else reach[r]["iterations"])
                       for r in rel}
                key = f"{model}/{setting}/{seed}"
                numbers[key] = {"target": s["target_validation_loss"], "rel": rel,
                                "iterations_to_target": its, "auto": auto}
                cells = " | ".join(f"{_pct(rel.get(c))} | {its.get(c) or 'never'}"
                                   for c in cols)
                auto_run = f"{STALE[0]}+{auto}" if auto != NONE else STALE[0]
                lines.append(f"| {model} | {setting} | {seed} | {s['target_validation_loss']:.4f}"
                             f" | {its.get(BASELINE)} | {cells} | {auto} "
                             f"{_pct(rel.get(auto_run))} |")
    return "\n".join(lines), numbers


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gpt,bert")
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--seeds", default="1234,7,99")
    p.add_argument("--train-iters", type=int, default=1000)
    p.add_argument("--eval-interval", type=int, default=50)
    p.add_argument("--out-dir", default="bench/results/convergence_1000it")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--json", default=None, help="write the numbers here")
    args = p.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    settings = [s for s in args.settings.split(",") if s]
    seeds = [int(s) for s in args.seeds.split(",") if s]
    for s in settings:
        if s not in SETTINGS:
            p.error(f"--settings: {s!r} is not one of {', '.join(SETTINGS)}")
    if not args.report_only:
        for model in models:
            for setting in settings:
                for seed in seeds:
                    run_cell(args.out_dir, model, setting, seed, args.train_iters,
                             args.eval_interval)
    text, numbers = report(args.out_dir, models, settings, seeds)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(numbers, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
