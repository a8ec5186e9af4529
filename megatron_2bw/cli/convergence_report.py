"""The outputs of tools/compare_convergence.py: CSV files, the PNG, the table and the numbers in
summary.json, from the curves of the runs.

Vocabulary:
- a *run* is a schedule, optionally with a 2BW compensation: `2bw`, `2bw+predict`, `gpipe`;
- `curves[run]`: training loss per iteration (1-based position = iteration);
- `validation[run]`: [[iteration, validation loss, seconds since the run started], ...], the
  same held-out microbatches at every point (compare_convergence.held_out);
- final training loss: mean of the last 10% of the iterations; final validation loss: the last
  validation point;
- target: the baseline's (gpipe's) final validation loss; a run's time to target is the first
  validation point at or below it (iterations and seconds), None if it never gets there.
"""
from __future__ import annotations

import csv
import io
import textwrap

from megatron_2bw.config.input_files import file_error, read_text
from megatron_2bw.config.numbers import is_finite
from megatron_2bw.fs import atomic_write_text

BASELINE = "gpipe"  # the run the others are compared with
PALETTE = ("#d62728", "#ff7f0e", "#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2")


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


def rel_diff(value: float | None, ref: float | None) -> float | None:
    """(value - ref) / ref; +0.0 for float-order noise (so tables print +0.00%, not -0.00%)."""
    if value is None or not ref:
        return None
    rel = (value - ref) / ref
    return 0.0 if abs(rel) < 5e-5 else rel


def to_target(points: list, target: float | None) -> tuple[int, float] | None:
    """(iteration, seconds) of the first validation point at or below `target`, else None."""
    if target is None:
        return None
    for it, loss, secs in points:
        if loss <= target:
            return int(it), float(secs)
    return None


# -- CSV --------------------------------------------------------------------------------------------
def write_csv(path: str, curves: dict) -> None:
    names = list(curves)
    n = max(len(v) for v in curves.values())
    out = io.StringIO(newline="")
    w = csv.writer(out)
    w.writerow(["iteration"] + names)
    for i in range(n):
        w.writerow([i + 1] + [f"{curves[s][i]:.6f}" if i < len(curves[s]) else ""
                              for s in names])
    atomic_write_text(path, out.getvalue())


def read_csv(path: str) -> dict:
    """{run: losses} of a losses.csv (write_csv's); one-line ConfigError when it is not one."""
    fix = "--from-csv takes the losses.csv an earlier run of this tool wrote"
    rows = list(csv.reader(io.StringIO(read_text(path, fix))))
    if not rows or rows[0][:1] != ["iteration"] or len(rows[0]) < 2 or len(rows) < 2:
        raise file_error(path, "not a losses.csv (a header 'iteration,RUN,...' and a row per "
                               "iteration)", fix)
    names = rows[0][1:]
    try:
        curves = {s: [float(r[i + 1]) for r in rows[1:] if r[i + 1] != ""]
                  for i, s in enumerate(names)}
    except (ValueError, IndexError):
        raise file_error(path, "a row is short or holds something that is no number", fix) \
            from None
    if not all(curves.values()) or not all(map(is_finite, sum(curves.values(), []))):
        raise file_error(path, "a column has no losses, or a loss that is not finite", fix)
    return curves


def write_validation_csv(path: str, validation: dict) -> None:
    """iteration, then each run's validation loss, then each run's seconds at that point."""
    names = [s for s in validation if validation[s]]
    its = sorted({int(p[0]) for s in names for p in validation[s]})
    by = {s: {int(p[0]): p for p in validation[s]} for s in names}
    out = io.StringIO(newline="")
    w = csv.writer(out)
    w.writerow(["iteration"] + names + [f"{s} seconds" for s in names])
    for it in its:
        w.writerow([it] + [f"{by[s][it][1]:.6f}" if it in by[s] else "" for s in names]
                   + [f"{by[s][it][2]:.2f}" if it in by[s] else "" for s in names])
    atomic_write_text(path, out.getvalue())


# -- training logs ----------------------------------------------------------------------------------
def curves_from_log(text: str) -> tuple[list, list]:
    """(training loss per iteration, [[iteration, validation loss, seconds], ...]) of a
    training log (a SLURM log of pretrain_gpt.py or of Megatron-LM's pretrain_gpt.py: Megatron's
    lines, ours, or the ones megatron-2bw printed before; training/observe/log_line.py reads
    them all). A log holds interval means: each interval's `lm loss` stands for each of its
    iterations (an interval without one, all fp16 steps skipped, takes its neighbours'). The
    seconds are the lines' elapsed time per iteration summed up to the point (training time:
    evaluations and checkpoints left out)."""
    from megatron_2bw.training.observe.log_line import parse_line
    means, ms, validation, last = [], [], [], 0
    for line in text.splitlines():
        parsed = parse_line(line)
        if parsed is None:
            continue
        it, fields = parsed
        if "lm loss value" in fields:
            validation.append([it, fields["lm loss value"], None])
        elif it > last:
            n, last = it - last, it
            means += [fields.get("lm loss")] * n
            ms += [fields.get("elapsed time per iteration (ms)", 0.0)] * n
    known = [x for x in means if isinstance(x, float)]
    if not known:
        raise ValueError("no interval line with an lm loss in the log")
    curve, fill = [], known[0]
    for x in means:
        fill = x if isinstance(x, float) else fill
        curve.append(fill)
    for point in validation:
        point[2] = sum(v for v in ms[:point[0]] if isinstance(v, float)) / 1e3
    return curve, validation


# -- summary and table ------------------------------------------------------------------------------
def summarize(curves: dict, validation: dict, seconds: dict) -> dict:
    """The numbers of summary.json (without the flags)."""
    finals = {s: final_loss(v) for s, v in curves.items()}
    val_finals = {s: (validation[s][-1][1] if validation.get(s) else None) for s in curves}
    target = val_finals.get(BASELINE)
    reach = {s: to_target(validation.get(s) or [], target) for s in curves}
    return {"iterations": max(len(v) for v in curves.values()),
            "final_loss": finals, "first_loss": {s: v[0] for s, v in curves.items()},
            "seconds": seconds,
            "rel_diff_vs_gpipe": {s: rel_diff(finals[s], finals.get(BASELINE)) for s in curves},
            "validation": validation, "final_validation_loss": val_finals,
            "validation_rel_diff_vs_gpipe": {s: rel_diff(val_finals[s], target) for s in curves},
            "target_validation_loss": target,
            "to_target": {s: (None if r is None else {"iterations": r[0], "seconds": r[1]})
                          for s, r in reach.items()}}


def _pct(rel: float | None) -> str:
    return "-" if rel is None else f"{100 * rel:+.2f}%"


def table(summary: dict) -> str:
    """The markdown table compare_convergence prints (and bench/README.md quotes)."""
    s = summary
    target = s.get("target_validation_loss")
    head = ("| run | first loss | final train loss | vs gpipe | final val loss | vs gpipe | "
            f"iters to {'-' if target is None else f'{target:.4f}'} | s to target | time (s) |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for run in s["final_loss"]:
        val = (s.get("final_validation_loss") or {}).get(run)
        reach = (s.get("to_target") or {}).get(run)
        secs = (s.get("seconds") or {}).get(run)
        lines.append(
            f"| {run} | {s['first_loss'][run]:.4f} | {s['final_loss'][run]:.4f} | "
            f"{_pct(s['rel_diff_vs_gpipe'].get(run))} | "
            f"{'-' if val is None else f'{val:.4f}'} | "
            f"{_pct((s.get('validation_rel_diff_vs_gpipe') or {}).get(run))} | "
            f"{'never' if reach is None else reach['iterations']} | "
            f"{'-' if reach is None else '%.0f' % reach['seconds']} | "
            f"{'-' if secs is None else f'{secs:.0f}'} |")
    return "\n".join(lines)


# -- PNG --------------------------------------------------------------------------------------------
def _style(run: str, schedule_delay) -> str:
    """Dashed for a run with the baseline's semantics (its curve lies on the baseline's)."""
    same = run != BASELINE and schedule_delay(run) == schedule_delay(BASELINE)
    return "--" if same else "-"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def loss_legend_title(n: int) -> str:
    """What the smoothed curves and the final values are, for runs of `n` iterations."""
    window, last = max(1, n // 20), max(1, int(round(n * 0.1)))
    smoothing = (f"moving average over {window} iterations" if window > 1 else
                 "no moving average (under 40 iterations)")
    final = "the last iteration" if last == 1 else f"mean of the last {last} iterations"
    return f"{smoothing}; final = {final}"


def plot(path: str, curves: dict, summary: dict, title: str, schedule_delay) -> None:
    """Write `figure(...)` to `path` (PNG)."""
    fig = figure(curves, summary, title, schedule_delay)
    import matplotlib.pyplot as plt
    fig.savefig(path, dpi=120)
    plt.close(fig)


def figure(curves: dict, summary: dict, title: str, schedule_delay):
    """Training loss (raw and moving average), each run's smoothed relative difference to
    gpipe, and validation loss against seconds with gpipe's final validation loss marked.
    `schedule_delay(run)` is the delay of the run's schedule (dashed when it equals gpipe's).
    Iteration axes have whole-number ticks."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    colours = dict(zip(curves, PALETTE))
    n = max(len(v) for v in curves.values())
    window = max(1, n // 20)
    validation = summary.get("validation") or {}
    rows = 3 if any(validation.values()) else 2
    fig, axes = plt.subplots(rows, 1, figsize=(9, 3.2 + 2.4 * rows),
                             gridspec_kw={"height_ratios": [3, 1.3, 2][:rows]})
    ax, bx = axes[0], axes[1]
    for s, ys in curves.items():
        xs = list(range(1, len(ys) + 1))
        if window > 1:  # the raw curve under the smoothed one
            ax.plot(xs, ys, color=colours[s], alpha=0.25, lw=0.8)
        ax.plot(xs, smooth(ys, window), color=colours[s], lw=1.8,
                ls=_style(s, schedule_delay),
                label=f"{s}  (final {summary['final_loss'][s]:.4f})")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title(title, fontsize=9)
    ax.legend(title=loss_legend_title(n))
    ax.grid(alpha=0.3)
    if BASELINE in curves:
        ref = smooth(curves[BASELINE], window)
        for s, ys in curves.items():
            if s != BASELINE:
                rel = [100 * (a - b) / b for a, b in zip(smooth(ys, window), ref)]
                bx.plot(range(1, len(rel) + 1), rel, color=colours[s], lw=1.5, label=s,
                        ls=_style(s, schedule_delay))
        bx.axhline(0, color=colours[BASELINE], lw=1)
        for y in (-3, 3):
            bx.axhline(y, color="grey", lw=0.8, ls="--")
        bx.set_ylabel("vs gpipe (%)")
        bx.legend(fontsize=8, loc="upper right")
    bx.set_xlabel("iteration")
    bx.grid(alpha=0.3)
    for axis in (ax, bx):
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    if rows == 3:
        cx = axes[2]
        for s, pts in validation.items():
            if pts:
                cx.plot([p[2] for p in pts], [p[1] for p in pts], marker=".", color=colours[s],
                        ls=_style(s, schedule_delay), label=f"{s}  (final {pts[-1][1]:.4f})")
        target = summary.get("target_validation_loss")
        if target is not None:
            cx.axhline(target, color="grey", lw=0.8, ls=":", label="gpipe's final")
        cx.set_xlabel("seconds since the run started (wall clock, this machine)")
        cx.set_ylabel("validation loss")
        cx.legend(fontsize=8, loc="upper right")
        cx.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def wrap(text: str, width: int) -> str:
    return "\n".join(textwrap.wrap(text, width))
