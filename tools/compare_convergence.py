#!/usr/bin/env python
"""Train the same GPT (or BERT) with 2bw, flush and gpipe and compare their loss curves.

    python tools/compare_convergence.py                          # README's model, 300 iters
    python tools/compare_convergence.py --train-iters 500 --out-dir conv -- --lr 2e-3
    python tools/compare_convergence.py --model-type bert --wandb

Every run goes through the real training code (`megatron_2bw.pretrain.parse` for the flags, the
data and the config, then `megatron_2bw.training.train`) on `--nproc` local gloo processes (one
thread each), one schedule after the other, with the same seed, data order and lr schedule. The
default model and data are the README's main job (embedded default corpus, 4 layers, hidden 64,
4 heads, seq 32, micro batch 4, global batch 32, --init-method-std 0.1, 2 pipeline stages) with
the usual GPT pretraining optimizer settings: lr 1e-3 warmed up over the first 10% of the
iterations, cosine decay to 1e-4, Adam beta2 0.95. Flags after `--` are passed to the pretrain
parser and override them (the last value wins).

2BW applies each batch's gradient one step late (W(t+1) = W(t) - lr * grad f(W(t-1))), so its
gap to gpipe grows with the learning rate: in 300 iterations of the default model it is about
+2% at lr 1e-3 and +9% at lr 3e-3 (Adam beta2 0.999; bench/README.md has the sweep).

Writes OUT/losses.csv (iteration, one column per schedule), OUT/convergence.png (raw curves,
a moving average, and each schedule's smoothed relative difference to gpipe) and
OUT/summary.json, and prints the final losses (mean of the last 10% of iterations) and their
differences. `--wandb` also logs every run to wandb (offline unless WANDB_MODE says otherwise)
as `{group}-{schedule}` in one group (WANDB_RUN_GROUP), under OUT/wandb.

Exit status: 0, or 1 when `--max-rel-diff` is given and 2bw's final loss is further than that
from gpipe's.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_2bw.pipeline.registry import schedule_kind, schedule_names  # noqa: E402

SCHEDULES = schedule_names()
BASELINE = "gpipe"  # the curve the others are compared with
DEFAULT_FLAGS = ["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--hidden-size", "64",
                 "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "4",
                 "--global-batch-size", "32", "--init-method-std", "0.1",
                 "--lr", "1e-3", "--lr-decay-style", "cosine", "--min-lr", "1e-4",
                 "--adam-beta2", "0.95"]
TINY_FLAGS = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
              "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8"]


def _worker(rank, world, family, argv, out_path, prefix):
    from megatron_2bw.pretrain import parse
    from megatron_2bw.training import batches, build_grid, train
    parsed = parse(family, argv)
    cfg, data = parsed.cfg, parsed.data
    grid = build_grid(cfg, rank, world)
    losses = train(cfg, grid, "cpu", lr_schedule=parsed.lr_schedule,
                   make_data=lambda start: batches(cfg, data.train, grid.data, grid.dp_rank,
                                                   start),
                   log=lambda line: print(f"{prefix}{line}", flush=True))
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(losses, f)


def run_schedule(schedule: str, family: str, argv: list, nproc: int, out_dir: str,
                 wandb_group: str | None, wandb_project: str = "megatron-2bw-convergence"
                 ) -> list:
    from megatron_2bw.launch import spawn
    path = os.path.join(out_dir, f"losses_{schedule}.json")
    argv = argv + ["--pipeline-schedule", schedule]
    if wandb_group:
        os.environ["WANDB_RUN_GROUP"] = wandb_group
        os.environ.setdefault("WANDB_MODE", "offline")
        argv += ["--wandb-project", wandb_project, "--wandb-exp-name",
                 f"{wandb_group}-{schedule}", "--wandb-save-dir", os.path.join(out_dir, "wandb")]
    spawn(_worker, nproc, args=(family, argv, path, f"[{schedule}] "), timeout_minutes=10)
    with open(path) as f:
        return json.load(f)


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


def final_loss(losses: list, fraction: float = 0.1) -> float:
    k = max(1, int(round(len(losses) * fraction)))
    tail = losses[-k:]
    return sum(tail) / len(tail)


def smooth(xs: list, window: int) -> list:
    """Trailing moving average (the first points average what exists so far)."""
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= window:
            acc -= xs[i - window]
        out.append(acc / min(i + 1, window))
    return out


def write_csv(path: str, curves: dict) -> None:
    names = list(curves)
    n = max(len(v) for v in curves.values())
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["iteration"] + names)
        for i in range(n):
            w.writerow([i + 1] + [f"{curves[s][i]:.6f}" if i < len(curves[s]) else ""
                                  for s in names])


def read_csv(path: str) -> dict:
    with open(path) as f:
        rows = list(csv.reader(f))
    names = rows[0][1:]
    return {s: [float(r[i + 1]) for r in rows[1:] if r[i + 1] != ""] for i, s in enumerate(names)}


COLOURS = dict(zip(SCHEDULES, ("#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#8c564b")))


def _style(s: str) -> str:
    """Dashed for a schedule with the baseline's semantics (its curve lies on the baseline's)."""
    same = s != BASELINE and schedule_kind(s).delay == schedule_kind(BASELINE).delay
    return "--" if same else "-"


def plot(path: str, curves: dict, finals: dict, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    n = max(len(v) for v in curves.values())
    window = max(1, n // 20)
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(9, 7), sharex=True,
                                 gridspec_kw={"height_ratios": [3, 1.3]})
    for s, ys in curves.items():
        xs = list(range(1, len(ys) + 1))
        c = COLOURS.get(s)
        ax.plot(xs, ys, color=c, alpha=0.25, lw=0.8)
        ax.plot(xs, smooth(ys, window), color=c, lw=1.8, ls=_style(s),
                label=f"{s}  (final {finals[s]:.4f})")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title(title, fontsize=10)
    ax.legend(title=f"moving average over {window} iterations; final = mean of last 10%")
    ax.grid(alpha=0.3)
    if BASELINE in curves:
        ref = smooth(curves[BASELINE], window)
        for s, ys in curves.items():
            if s == BASELINE:
                continue
            sm = smooth(ys, window)
            rel = [100 * (a - b) / b for a, b in zip(sm, ref)]
            bx.plot(range(1, len(rel) + 1), rel, color=COLOURS.get(s), lw=1.5, label=s,
                    ls=_style(s))
        bx.axhline(0, color=COLOURS[BASELINE], lw=1)
        for y in (-3, 3):
            bx.axhline(y, color="grey", lw=0.8, ls="--")
        bx.set_ylabel("vs gpipe (%)")
        bx.legend(fontsize=8, loc="upper right")
        bx.grid(alpha=0.3)
    bx.set_xlabel("iteration")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-type", choices=("gpt", "bert"), default="gpt")
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--train-iters", type=int, default=300)
    p.add_argument("--nproc", type=int, default=2, help="processes per run (world size)")
    p.add_argument("--out-dir", default="convergence")
    p.add_argument("--wandb", action="store_true", help="log each run to wandb, one group")
    p.add_argument("--wandb-group", default=None, help="default: convergence-<model>-<time>")
    p.add_argument("--wandb-project", default="megatron-2bw-convergence")
    p.add_argument("--max-rel-diff", type=float, default=None,
                   help="exit 1 if |2bw - gpipe| / gpipe final loss exceeds this (e.g. 0.03)")
    p.add_argument("--from-csv", default=None,
                   help="do not train: redraw the plot and the table from a losses.csv")
    p.add_argument("--tiny", action="store_true", help="a seconds-long smoke run (tests)")
    p.add_argument("pretrain_flags", nargs=argparse.REMAINDER,
                   help="-- then pretrain flags that override the defaults")
    args = p.parse_args(argv)
    flags = list(args.pretrain_flags)
    if flags and flags[0] == "--":
        flags = flags[1:]
    if "--pipeline-schedule" in flags:
        p.error("--pipeline-schedule is set per run by this tool; use --schedules")
    args.schedule_list = [s.strip() for s in args.schedules.split(",") if s.strip()]
    bad = [s for s in args.schedule_list if s not in SCHEDULES]
    if bad or not args.schedule_list:
        p.error(f"--schedules: choose from {', '.join(SCHEDULES)}")
    iters = 4 if args.tiny else args.train_iters
    args.flags = DEFAULT_FLAGS + (TINY_FLAGS if args.tiny else []) + \
        ["--train-iters", str(iters), "--log-interval", str(max(1, iters // 10)),
         "--lr-warmup-iters", str(iters // 10)] + flags
    return args


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
    curves, seconds = {}, {}
    if args.from_csv:
        curves = read_csv(args.from_csv)
        seconds = {s: None for s in curves}
        old = os.path.join(os.path.dirname(os.path.abspath(args.from_csv)), "summary.json")
        if os.path.exists(old):
            with open(old) as f:
                prev = json.load(f)
            args.flags = prev.get("flags", args.flags)
            seconds.update(prev.get("seconds", {}))
    for s in [] if args.from_csv else args.schedule_list:
        t0 = time.time()
        curves[s] = run_schedule(s, args.model_type, args.flags, args.nproc, args.out_dir, group,
                                 args.wandb_project)
        seconds[s] = time.time() - t0
    finals = {s: final_loss(v) for s, v in curves.items()}
    csv_path = os.path.join(args.out_dir, "losses.csv")
    png_path = os.path.join(args.out_dir, "convergence.png")
    write_csv(csv_path, curves)
    n = max(len(v) for v in curves.values())
    title = f"{args.model_type.upper()} {' '.join(effective_flags(args.flags))}"
    plot(png_path, curves, finals, _wrap(title, 110))
    ref = finals.get(BASELINE)
    print()
    print("| schedule | first loss | final loss (mean of last 10%) | vs gpipe | time (s) |")
    print("|----------|------------|-------------------------------|----------|----------|")
    summary = {"flags": effective_flags(args.flags), "model_type": args.model_type, "iterations": n,
               "final_loss": finals, "first_loss": {s: v[0] for s, v in curves.items()},
               "seconds": seconds, "rel_diff_vs_gpipe": {}, "wandb_group": group}
    for s in curves:
        rel = (finals[s] - ref) / ref if ref else None
        if rel is not None and abs(rel) < 5e-5:
            rel = 0.0  # print +0.00%, not -0.00%, for float-order noise
        summary["rel_diff_vs_gpipe"][s] = rel
        secs = "-" if seconds.get(s) is None else f"{seconds[s]:.0f}"
        print(f"| {s:8} | {curves[s][0]:10.4f} | {finals[s]:29.4f} | "
              f"{'-' if rel is None else f'{100 * rel:+.2f}%':>8} | {secs:>8} |")
    print(f"\nwrote {csv_path}, {png_path}")
    with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    rel = summary["rel_diff_vs_gpipe"].get("2bw")
    if rel is not None:
        print(f"2bw final loss vs gpipe: {100 * rel:+.2f}% "
              f"({'within' if abs(rel) <= 0.03 else 'NOT within'} 3%)")
        if args.max_rel_diff is not None and abs(rel) > args.max_rel_diff:
            return 1
    if group:
        print(f"wandb group {group}: runs under {os.path.join(args.out_dir, 'wandb')}")
    return 0


def _wrap(text: str, width: int) -> str:
    import textwrap
    return "\n".join(textwrap.wrap(text, width))


if __name__ == "__main__":
    sys.exit(main())
