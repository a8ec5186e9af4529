#!/usr/bin/env python
"""Train the same GPT (or BERT) with 2bw (plain and compensated), flush and gpipe and compare their
training loss, their held-out validation loss, and the iterations and seconds each needs to reach
gpipe's final validation loss.

    python tools/compare_convergence.py                          # README's model, 300 iters
    python tools/compare_convergence.py --schedules 2bw,2bw+predict,gpipe -- --lr 3e-3
    python tools/compare_convergence.py --train-iters 500 --out-dir conv -- --lr 2e-3
    python tools/compare_convergence.py --model-type bert --wandb

A run is a schedule (`--pipeline-schedule`), optionally with a 2BW staleness compensation after a
`+` (`2bw+predict` = `--pipeline-schedule 2bw --2bw-compensation predict`,
megatron_2bw/pipeline/compensation.py). Every run goes through the real training code
(`megatron_2bw.pretrain.parse` for the flags, the data and the config, then
`megatron_2bw.training.loop.train`) on `--nproc` local gloo processes (one thread each), one run
after the other, with the same seed, data order and lr schedule. The default model and data are the
README's main job (embedded default corpus, 4 layers, hidden 64, 4 heads, seq 32, micro batch 4,
global batch 32, --init-method-std 0.1, 2 pipeline stages) with the usual GPT pretraining
optimizer settings: lr 1e-3 warmed up over the first 10% of the iterations, cosine decay to 1e-4,
Adam beta2 0.95. Flags after `--` are passed to the pretrain parser and override them (the last
value wins).

Validation: every `--eval-interval` iterations each run evaluates the same `--eval-iters` batches
of the held-out split (the corpus' validation part, the same microbatches at every point and in
every run), and the time since the run started is noted with it. The target is gpipe's final
validation loss; each run's time to target is its first validation point at or below it.
Seconds are wall clock on this machine: compare them only within one invocation (same load).

Plain 2BW applies each batch's gradient one step late (W(t+1) = W(t) - lr * grad f(W(t-1))): in
300 iterations of the default model its final loss is about +1.7% above gpipe's, +17.6% at a
constant lr 3e-3 (bench/README.md has the sweep, and what each compensation recovers).

`--from-logs RUN=LOG ...` trains nothing: it compares the runs of existing training logs (a
SLURM log of our pretrain_gpt.py, new or old line format, or of Megatron-LM's; each interval's
mean loss stands for its iterations, seconds are the logged training time).

Writes OUT/losses.csv (iteration, one column per run), OUT/validation.csv (iteration, each run's
validation loss, each run's seconds), OUT/convergence.png (raw curves, a moving average, each
run's smoothed relative difference to gpipe, validation loss against seconds) and
OUT/summary.json, and prints the table (tools/convergence_report.py). `--wandb` also logs every
run to wandb (offline unless WANDB_MODE says otherwise) as `{group}-{run}` in one group
(WANDB_RUN_GROUP), under OUT/wandb.

Exit status: 0, or 1 when `--max-rel-diff` is given and plain 2bw's final training loss is
further than that from gpipe's, or when `--max-val-rel-diff` is given and a compensated 2BW run's
final validation loss is further than that from gpipe's.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time


from megatron_2bw.cli.convergence_report import (BASELINE, curves_from_log, plot, read_csv,
                                                 summarize, table, wrap, write_csv,
                                                 write_validation_csv)
from megatron_2bw.config import ConfigError
from megatron_2bw.config.input_files import read_json
from megatron_2bw.config.numbers import FiniteParser
from megatron_2bw.fs import atomic_write_text
from megatron_2bw.schedule.compensation_methods import NONE, compensation_error, method_names
from megatron_2bw.schedule.kinds import schedule_kind, schedule_names

SCHEDULES = schedule_names()
DEFAULT_FLAGS = ["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--hidden-size", "64",
                 "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "4",
                 "--global-batch-size", "32", "--init-method-std", "0.1",
                 "--lr", "1e-3", "--lr-decay-style", "cosine", "--min-lr", "1e-4",
                 "--adam-beta2", "0.95",
                 # no dropout (Megatron's default is 0.1): the comparison is of the schedules,
                 # and bench/README's recorded comparisons ran without it
                 "--hidden-dropout", "0", "--attention-dropout", "0"]
TINY_FLAGS = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
              "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8"]
COMPENSATIONS = [m for m in method_names() if m != NONE]
# every schedule, each one-step-stale one followed by its compensated runs
DEFAULT_RUNS = ",".join(run for s in SCHEDULES for run in [s] + (
    [f"{s}+{m}" for m in COMPENSATIONS] if schedule_kind(s).delay == 1 else []))
SET_PER_RUN = ("--pipeline-schedule", "--2bw-compensation", "--eval-interval", "--eval-iters")


def split_run(run: str) -> tuple[str, str]:
    """"2bw+predict" -> ("2bw", "predict"); "gpipe" -> ("gpipe", "none")."""
    schedule, _, method = run.partition("+")
    return schedule, method or NONE


def run_error(run: str) -> str | None:
    """A one-line error for a --schedules entry that names no schedule/compensation, else None."""
    schedule, method = split_run(run)
    if schedule not in SCHEDULES:
        return f"--schedules: {run!r} names no schedule: choose from {', '.join(SCHEDULES)}"
    if "+" in run and method not in COMPENSATIONS:
        return (f"--schedules: {run!r}: after '+' name a 2BW compensation: "
                f"{', '.join(COMPENSATIONS)}")
    error = compensation_error(method, schedule, "adam", 0.9)
    return None if error is None else f"--schedules {run}: {error}"


def held_out(cfg, dataset, grid):
    """The first --eval-iters batches of the validation split for this replica, again and again:
    every evaluation of every run sees the same microbatches."""
    from megatron_2bw.training.build import batches
    first = list(itertools.islice(batches(cfg, dataset, grid.data, grid.dp_rank),
                                  cfg.train.eval_iters * cfg.num_microbatches))
    return itertools.cycle(first)


def _worker(rank, world, family, argv, out_path, prefix):
    from megatron_2bw.parallel.grid import ProcessGrid
    from megatron_2bw.training.observe.logger import parse_line
    from megatron_2bw.pretrain import parse
    from megatron_2bw.training.build import batches
    from megatron_2bw.training.loop import train
    parsed = parse(family, argv)
    cfg, data = parsed.cfg, parsed.data
    grid = ProcessGrid.from_config(cfg, rank, world).init_groups()
    validation, started = [], time.time()

    def log(line):
        print(f"{prefix}{line}", flush=True)
        fields = parse_line(line)  # Megatron's validation line (or our earlier one)
        if fields and "lm loss value" in fields[1]:
            validation.append([fields[0], fields[1]["lm loss value"], time.time() - started])

    losses = train(cfg, grid, "cpu", lr_schedule=parsed.lr_schedule,
                   make_data=lambda start: batches(cfg, data.train, grid.data, grid.dp_rank,
                                                   start),
                   make_eval_data=lambda: held_out(cfg, data.valid, grid), log=log,
                   beside=parsed.beside)
    if rank == 0:
        atomic_write_text(out_path, json.dumps(losses))
    if validation:  # the reporting rank (last stage)
        atomic_write_text(out_path + ".validation", json.dumps(validation))


def run_one(run: str, family: str, argv: list, nproc: int, out_dir: str,
            wandb_group: str | None, wandb_project: str = "megatron-2bw-convergence"
            ) -> tuple[list, list]:
    """(training losses, validation points) of one run."""
    from megatron_2bw.training.spawn import spawn
    schedule, method = split_run(run)
    path = os.path.join(out_dir, f"losses_{run}.json")
    argv = argv + ["--pipeline-schedule", schedule, "--2bw-compensation", method]
    if wandb_group:
        os.environ["WANDB_RUN_GROUP"] = wandb_group
        os.environ.setdefault("WANDB_MODE", "offline")
        argv += ["--wandb-project", wandb_project, "--wandb-exp-name",
                 f"{wandb_group}-{run}", "--wandb-save-dir", os.path.join(out_dir, "wandb")]
    spawn(_worker, nproc, args=(family, argv, path, f"[{run}] "), timeout_minutes=10)
    with open(path) as f:
        losses = json.load(f)
    validation = []
    if os.path.exists(path + ".validation"):
        with open(path + ".validation") as f:
            validation = json.load(f)
    return losses, validation


def effective_flags(flags: list) -> list:
    """The flags as the parser sees them: a repeated flag keeps its last value (in place of its
    first occurrence), so titles and logs show what actually ran."""
    order, values, i = [], {}, 0
    while i < len(flags):
        name = flags[i]
        has_value = i + 1 < len(flags) and not flags[i + 1].startswith("--")
        if name not in values:
            order.append(name)
        values[name] = flags[i + 1] if has_value else None
        i += 2 if has_value else 1
    out = []
    for name in order:
        out += [name] + ([values[name]] if values[name] is not None else [])
    return out


def parse_args(argv=None):
    p = FiniteParser(description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-type", choices=("gpt", "bert"), default="gpt")
    p.add_argument("--schedules", default=DEFAULT_RUNS,
                   help="runs: schedules, a 2BW compensation after '+' (2bw+predict, ...)")
    p.add_argument("--train-iters", type=int, default=300)
    p.add_argument("--eval-interval", type=int, default=None,
                   help="iterations between validation points (default: --train-iters / 15)")
    p.add_argument("--eval-iters", type=int, default=4,
                   help="held-out batches per validation point (the same ones every time)")
    p.add_argument("--nproc", type=int, default=2, help="processes per run (world size)")
    p.add_argument("--out-dir", default="convergence")
    p.add_argument("--wandb", action="store_true", help="log each run to wandb, one group")
    p.add_argument("--wandb-group", default=None, help="default: convergence-<model>-<time>")
    p.add_argument("--wandb-project", default="megatron-2bw-convergence")
    p.add_argument("--max-rel-diff", type=float, default=None,
                   help="exit 1 if |2bw - gpipe| / gpipe final training loss exceeds this")
    p.add_argument("--max-val-rel-diff", type=float, default=None,
                   help="exit 1 if |compensated 2BW - gpipe| / gpipe final validation loss "
                        "exceeds this (e.g. 0.005)")
    p.add_argument("--from-csv", default=None,
                   help="do not train: redraw the plot and the table from a losses.csv")
    p.add_argument("--from-logs", nargs="+", default=None, metavar="RUN=LOG",
                   help="do not train: compare the runs of these training logs (SLURM logs "
                        "of pretrain_gpt.py, ours or Megatron-LM's; RUN names the run as "
                        "--schedules does: gpipe=gpipe.out 2bw=2bw.out)")
    p.add_argument("--tiny", action="store_true", help="a seconds-long smoke run (tests)")
    p.add_argument("pretrain_flags", nargs=argparse.REMAINDER,
                   help="-- then pretrain flags that override the defaults")
    args = p.parse_args(argv)
    flags = list(args.pretrain_flags)
    if flags and flags[0] == "--":
        flags = flags[1:]
    for flag in SET_PER_RUN:
        if flag in flags:
            p.error(f"{flag} is set by this tool; use --schedules (2bw+predict) or its own "
                    "--eval-interval / --eval-iters")
    args.schedule_list = [s.strip() for s in args.schedules.split(",") if s.strip()]
    if not args.schedule_list:
        p.error(f"--schedules: name at least one of {', '.join(SCHEDULES)}")
    for run in args.schedule_list:
        error = run_error(run)
        if error:
            p.error(error)
    for flag, value in (("--nproc", args.nproc), ("--train-iters", args.train_iters),
                        ("--eval-iters", args.eval_iters)):
        if value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    if args.from_csv:  # read here, so that a bad file is one line before anything runs
        try:
            args.curves = read_csv(args.from_csv)
        except ConfigError as e:
            p.error(str(e))
        bad = next((e for e in map(run_error, args.curves) if e), None)
        if bad:
            p.error(f"{args.from_csv}: {bad.replace('--schedules', 'a column')}")
    args.logs = {}
    for item in args.from_logs or []:
        run, _, path = item.partition("=")
        error = run_error(run) if path else f"--from-logs {item}: give RUN=LOG (2bw=2bw.out)"
        if error:
            p.error(error.replace("--schedules", "--from-logs"))
        args.logs[run] = path
    iters = 4 if args.tiny else args.train_iters
    interval = args.eval_interval or (2 if args.tiny else max(1, iters // 15))
    eval_iters = 1 if args.tiny else args.eval_iters
    args.flags = DEFAULT_FLAGS + (TINY_FLAGS if args.tiny else []) + \
        ["--train-iters", str(iters), "--log-interval", str(max(1, iters // 10)),
         "--lr-warmup-iters", str(iters // 10)] + flags + \
        ["--eval-interval", str(interval), "--eval-iters", str(eval_iters)]
    if args.logs:
        args.flags = []  # the logs' runs, whatever flags they had
    return args


def _delay(run: str) -> int:
    return schedule_kind(split_run(run)[0]).delay


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    group = None
    if args.wandb:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        group = args.wandb_group or f"convergence-{args.model_type}-{stamp}"
    print(f"# tools/compare_convergence.py  {time.strftime('%Y-%m-%d %H:%M %Z')}", flush=True)
    print(f"# {' '.join(['python', 'tools/compare_convergence.py'] + (argv or sys.argv[1:]))}",
          flush=True)
    print(f"# pretrain flags: {' '.join(effective_flags(args.flags))}", flush=True)
    curves, validation, seconds = {}, {}, {}
    if args.from_csv:
        curves = args.curves
        seconds = {s: None for s in curves}
        old = os.path.join(os.path.dirname(os.path.abspath(args.from_csv)), "summary.json")
        if os.path.exists(old):
            prev = read_json(old, "it is the summary.json an earlier run wrote beside the CSV: "
                                  "fix or remove it", dict, SystemExit)
            args.flags = prev.get("flags", args.flags)
            seconds.update(prev.get("seconds", {}))
            validation = prev.get("validation", {})
    for run, path in args.logs.items():
        with open(path) as f:
            text = f.read()
        try:
            curves[run], validation[run] = curves_from_log(text)
        except ValueError as e:
            print(f"error: --from-logs {run}={path}: {e}", file=sys.stderr)
            return 2
        seconds[run] = validation[run][-1][2] if validation[run] else None
    for run in [] if args.from_csv or args.logs else args.schedule_list:
        t0 = time.time()
        curves[run], validation[run] = run_one(run, args.model_type, args.flags, args.nproc,
                                               args.out_dir, group, args.wandb_project)
        seconds[run] = time.time() - t0
    summary = {"flags": effective_flags(args.flags), "model_type": args.model_type,
               **summarize(curves, validation, seconds), "wandb_group": group}
    csv_path = os.path.join(args.out_dir, "losses.csv")
    val_path = os.path.join(args.out_dir, "validation.csv")
    png_path = os.path.join(args.out_dir, "convergence.png")
    write_csv(csv_path, curves)
    write_validation_csv(val_path, validation)
    title = f"{args.model_type.upper()} {' '.join(effective_flags(args.flags))}" \
        if not args.logs else "from logs: " + ", ".join(f"{r}={p}" for r, p in args.logs.items())
    plot(png_path, curves, summary, wrap(title, 120), _delay)
    print()
    print(table(summary))
    print(f"\nwrote {csv_path}, {val_path}, {png_path}")
    atomic_write_text(os.path.join(args.out_dir, "summary.json"), json.dumps(summary, indent=1))
    status = 0
    rel = summary["rel_diff_vs_gpipe"].get("2bw")
    if rel is not None:
        print(f"2bw final loss vs gpipe: {100 * rel:+.2f}% "
              f"({'within' if abs(rel) <= 0.03 else 'NOT within'} 3%)")
        if args.max_rel_diff is not None and abs(rel) > args.max_rel_diff:
            status = 1
    for run, rel in summary["validation_rel_diff_vs_gpipe"].items():
        if split_run(run)[1] == NONE or rel is None:
            continue
        print(f"{run} final validation loss vs gpipe: {100 * rel:+.2f}%")
        if args.max_val_rel_diff is not None and abs(rel) > args.max_val_rel_diff:
            status = 1
    if group:
        print(f"wandb group {group}: runs under {os.path.join(args.out_dir, 'wandb')}")
    return status


if __name__ == "__main__":
    sys.exit(main())
