#!/usr/bin/env python
"""Draw a pipeline schedule as a timeline PNG: stages on the y axis, time on the x axis.

    python tools/plot_schedule.py --schedule 2bw -d 4 -m 8 --batches 3          # unit durations
    python tools/plot_schedule.py --schedule flush -d 4 -m 8 --durations F=1,B=2,S=1,R=0.5,N=0.5
    python tools/plot_schedule.py --schedule 2bw -d 8 -m 16 --model gpt-1.3b     # cost model
    python tools/plot_schedule.py --schedule gpipe -d 4 -m 8 --gpipe-microbatches-per-flush 2
    python tools/plot_schedule.py --trace run.json                              # engine trace

Blocks: forwards (blue) and backwards (orange), light for weight version v0 and dark for v1,
labelled with the microbatch (and `v1` where the block has room); optimizer steps S (green) and
the reduction actions R/N (purple) labelled with their batch; with a trace or a communication
latency, the time a stage spends blocked in p2p shows as a grey strip under its row.

Sources:
- the simulator (`pipeline.simulate`) replaying the engine's own action table with durations
  from `--durations` (F=1, B=2, S=0.5, R=N=0 unless given; zero-length actions are drawn as
  thin markers; `--comm-latency` per p2p group), or from
  the planner's cost model with `--model NAME` (`planner.cost_model.stage_plan` with an
  analytic profile, or `--profile FILE` from `tools/plan.py --profile-out`);
- an engine trace: `pretrain_gpt.py --trace FILE` writes FILE.rank<r>.json per rank; `--trace
  FILE` reads them all (one row per rank), times in ms from the earliest event.

`--print` also prints the text grid of the simulated table.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import sys


from megatron_2bw.config.numbers import FiniteParser, finite_float
from megatron_2bw.pipeline.trace_file import read_traces
from megatron_2bw.schedule import actions as A
from megatron_2bw.schedule.kinds import DEFAULT_SCHEDULE, schedule_kind_of, schedule_names

COLOURS = {("F", 0): "#9ecae1", ("F", 1): "#3182bd", ("B", 0): "#fdae6b", ("B", 1): "#e6550d",
           "S": "#31a354", "R": "#9e9ac8", "N": "#756bb1", "p2p": "#bdbdbd"}
DARK = {("F", 1), ("B", 1), "S", "N"}


# ---- sources ------------------------------------------------------------------------------------


def parse_durations(text: str | None) -> dict:
    out = {A.FORWARD: 1.0, A.BACKWARD: 2.0, A.STEP: 0.5, A.REDUCE: 0.0, A.NORM: 0.0}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        key, _, value = part.partition("=")
        key = key.strip()
        try:
            out[key] = finite_float(value) if key in out else None
        except (ValueError, argparse.ArgumentTypeError):
            out[key] = None
        if out[key] is None or out[key] < 0:
            raise SystemExit(f"--durations: bad entry {part!r}: use e.g. F=1,B=2,S=0.5,R=0,N=0.2 "
                             "(finite durations >= 0)")
    return out


def simulated(args):
    """(rows, unit, title) from the simulator."""
    from megatron_2bw.schedule.tables import make_schedule
    from megatron_2bw.schedule.simulate import simulate
    sched = make_schedule(_kind(args), args.pipeline_stages, args.num_microbatches,
                          args.batches)
    unit = "time units"
    if args.model:
        dur, comm, unit, what = cost_model_durations(args)
        res = simulate(sched, dur, comm)
        scale = 1e3
        unit = "ms (cost model)"
    else:
        what = ", ".join(f"{k}={v:g}" for k, v in parse_durations(args.durations).items())
        res = simulate(sched, parse_durations(args.durations), args.comm_latency)
        scale = 1.0
        if args.comm_latency:
            what += f", p2p={args.comm_latency:g}"
    rows = []
    for s, tl in enumerate(res.timeline):
        rows.append((f"stage {s}", [(a0 * scale, a1 * scale, [a]) for a0, a1, a in tl]))
    rows = _merge_comm(rows)
    flushes = args.gpipe_microbatches_per_flush
    title = (f"{args.schedule}{f' in flushes of {flushes}' if flushes else ''}  "
             f"d={args.pipeline_stages}  m={args.num_microbatches}  "
             f"batches={args.batches}  |  makespan {res.makespan * scale:.4g} {unit.split()[0]}, "
             f"{bubble_text(rows, res.bubble)}, peak in flight {res.peak_in_flight}\n"
             f"simulated with {what}")
    if args.print:
        print(res.grid())
    return rows, unit, title


def steady_bubble(rows) -> float | None:
    """The steady-state bubble: 1 - busy / period, where the period is the mean time between
    the last row's consecutive optimizer steps (the last stage never waits for a drain) and busy
    is a row's compute, step and reduction time per batch (mean over rows); None with fewer
    than two batches (no steady state to measure). Fill and drain are not in it."""
    steps = sorted(a1 for _, a1, acts in rows[-1][1] if acts[0].kind == A.STEP)
    if len(steps) < 2 or steps[-1] <= steps[0]:
        return None
    period = (steps[-1] - steps[0]) / (len(steps) - 1)
    busy = [sum(a1 - a0 for a0, a1, acts in ev if not acts[0].is_comm)
            / max(1, sum(acts[0].kind == A.STEP for _, _, acts in ev)) for _, ev in rows]
    return max(0.0, 1.0 - sum(busy) / len(busy) / period)


def bubble_text(rows, idle: float | None = None) -> str:
    """The title's words: the steady-state bubble, and the whole run's idle time (fill and
    drain included) when known."""
    steady = steady_bubble(rows)
    text = ("steady-state bubble n/a (one batch: use --batches 2+)" if steady is None else
            f"steady-state bubble {100 * steady:.1f}%")
    return text + ("" if idle is None else f" (idle {100 * idle:.1f}% with fill and drain)")


def _kind(args):
    """The schedule kind drawn (GPipe in flushes of K with --gpipe-microbatches-per-flush)."""
    return schedule_kind_of(args.schedule, None, args.gpipe_microbatches_per_flush)


def cost_model_durations(args):
    from megatron_2bw.models.flops import named_model
    from megatron_2bw.planner import AnalyticProfile, Layout, Setup, Topology, load_profile
    from megatron_2bw.planner.cost_model import LayerTimes, stage_plan
    try:  # an unknown name, a bad profile: the tool ends with their line
        model = named_model(args.model)
        profile = load_profile(args.profile) if args.profile else AnalyticProfile()
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    setup = Setup(model, args.dtype, "adam")
    topo = Topology(num_nodes=1, gpus_per_node=max(args.pipeline_stages, 1))
    layout = Layout(args.schedule, 1, args.pipeline_stages, 1, args.micro_batch_size,
                    args.num_microbatches,
                    microbatches_per_flush=args.gpipe_microbatches_per_flush)
    plan = stage_plan(setup, layout, LayerTimes(setup, profile, topo), topo)
    dur, comm = plan.durations()
    what = (f"the cost model: {args.model} {args.dtype} micro batch {args.micro_batch_size}, "
            f"{'profile ' + args.profile if args.profile else 'analytic profile'}")
    return dur, comm, "s", what


def _merge_comm(rows):
    """Simulator timelines list every comm op; merge each group's ops into one block."""
    out = []
    for name, events in rows:
        merged = []
        for a0, a1, acts in events:
            if acts[0].is_comm and merged and merged[-1][2][0].is_comm and \
                    abs(merged[-1][0] - a0) < 1e-12 and abs(merged[-1][1] - a1) < 1e-12:
                merged[-1][2].extend(acts)
            else:
                merged.append((a0, a1, list(acts)))
        out.append((name, merged))
    return out


def traced(path: str, skip_windows: int = 0):
    """(rows, unit, title) from FILE.rank*.json (or one JSON file); `skip_windows` drops every
    rank's events up to and including its k-th optimizer step (the warm-up)."""
    files = sorted(glob.glob(f"{path}.rank*.json"), key=_rank_key)
    if not files and os.path.isfile(path):
        files = [path]
    if not files:
        raise SystemExit(f"--trace {path}: no {path}.rank*.json files (pretrain_gpt.py --trace "
                         f"{path} writes them)")
    traces = read_traces(files, f"--trace {path}: give the files pretrain_gpt.py --trace "
                                f"{path} writes")
    if not any(t.get("events") for t in traces):
        raise SystemExit(f"--trace {path}: the trace files hold no events")
    for t in traces:
        events, seen = t.get("events", []), 0
        for i, e in enumerate(events):
            if seen >= skip_windows:
                t["events"] = events[i:]
                break
            seen += any(x.startswith(A.STEP) for x in e[0].split())
        else:
            t["events"] = []
    if not any(t["events"] for t in traces):
        raise SystemExit(f"--skip-windows {skip_windows}: the trace has no events after that")
    t0 = min(e[1] for t in traces for e in t.get("events", []))
    traces.sort(key=lambda t: (t.get("stage", 0), t.get("dp", 0), t.get("tp", 0), t["rank"]))
    many = len(traces) > (traces[0].get("num_stages") or len(traces))
    rows = []
    for t in traces:
        name = f"stage {t.get('stage')}" + (f" (rank {t['rank']})" if many else "")
        events = [((e[1] - t0) * 1e3, (e[2] - t0) * 1e3, [A.parse(x) for x in e[0].split()])
                  for e in t.get("events", [])]
        rows.append((name, events))
    end = max(e[1] for _, ev in rows for e in ev)
    sched = traces[0].get("schedule", "?")
    title = (f"engine trace {os.path.basename(path)}: {sched}, {len(traces)} ranks, "
             f"{end:.1f} ms" + (f" after the first {skip_windows} batches" if skip_windows
                                else "") + f", {bubble_text(rows)}")
    return rows, "ms", title


def _rank_key(f):
    m = re.search(r"\.rank(\d+)\.json$", f)
    return int(m.group(1)) if m else 0


# ---- drawing ------------------------------------------------------------------------------------


def block_style(acts):
    a = acts[0]
    if a.is_comm:
        return COLOURS["p2p"], ""
    if a.is_compute:
        key = (a.kind, min(a.version, 1))
        return COLOURS[key], str(a.mb)
    return COLOURS[a.kind], f"{a.kind}{a.batch}"


MAX_BATCHES = 3  # more batches than this: an automatic window of two steady-state batches


def auto_window(rows) -> tuple | None:
    """(start, end, first, last, batches) of two steady-state batches (the 2nd and 3rd optimizer
    steps of the last row) when the rows hold more than MAX_BATCHES batches, else None."""
    steps = sorted(a1 for _, a1, acts in rows[-1][1] if acts[0].kind == A.STEP)
    if len(steps) <= MAX_BATCHES:
        return None
    return steps[0], steps[2], 2, 3, len(steps)


def draw(rows, unit: str, title: str, out: str, window: tuple | None = None) -> str:
    """Write `figure(...)` to `out` (PNG); returns `out`."""
    fig = figure(rows, unit, title, window)
    import matplotlib.pyplot as plt
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def legend_entries(drawn) -> list:
    """(colour key, label) for what the drawn actions hold, and only that: a weight version
    that never occurs (v1 under flush and gpipe) has no entry."""
    keys = set()
    for acts in drawn:
        a = acts[0]
        keys.add("p2p" if a.is_comm else (a.kind, min(a.version, 1)) if a.is_compute else a.kind)
    names = [(("F", 0), "forward v0"), (("F", 1), "forward v1"), (("B", 0), "backward v0"),
             (("B", 1), "backward v1"), ("S", "optimizer step S<batch>"),
             ("R", "reduce R<batch>"), ("N", "norm/all-reduce N<batch>"),
             ("p2p", "blocked in p2p")]
    return [(k, label) for k, label in names if k in keys]


def figure(rows, unit: str, title: str, window: tuple | None = None, ax=None, xlim=None):
    """The timeline as a matplotlib figure. With no `window` and more than MAX_BATCHES
    batches it shows two steady-state batches (`auto_window`) and says so in the title.
    `ax`: draw into this axes of an existing figure (its legend under it), `xlim`: the x range
    (a shared time scale; default: the drawn range)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events = [e for _, ev in rows for e in ev]
    start = min(e[0] for e in events)
    end = max(e[1] for e in events)
    auto = None if window else auto_window(rows)
    if auto:
        start, end, first, last, batches = auto
        title += (f"\nshowing batches {first}-{last} of {batches} (steady state; "
                  f"--window START:END for another range)")
    elif window:
        start, end = window
    span = max(end - start, 1e-9)
    computes = [e for e in events if e[2][0].is_compute and e[1] > e[0]]
    shortest = min((e[1] - e[0] for e in computes), default=span / 40)
    # wide enough that the shortest compute block can hold a two-digit label, within reason
    width = min(max(10.0, 0.3 * span / shortest + 2), 26.0)
    height = max(1.2 + 0.55 * len(rows), 2.4)
    if ax is None:
        fig, ax = plt.subplots(figsize=(width, height))
    else:
        fig = ax.figure
        width, height = fig.get_size_inches()[0], ax.get_position().height * \
            fig.get_size_inches()[1]
    inch_per_unit = (width * 0.86) / ((xlim[1] - xlim[0]) if xlim else span)
    fontsize = 7
    drawn = []
    for y, (_, ev) in enumerate(rows):
        for a0, a1, acts in ev:
            if a1 < start or a0 > end:
                continue
            colour, text = block_style(acts)
            a = acts[0]
            if a.is_comm:
                if a1 - a0 > 0:  # time blocked in p2p (none: nothing drawn, no legend entry)
                    drawn.append(acts)
                    ax.broken_barh([(a0, a1 - a0)], (y + 0.30, 0.10), facecolors=colour,
                                   edgecolor="none")
                continue
            drawn.append(acts)
            w = a1 - a0
            if w <= 0:  # a zero-length action (R/N/S at duration 0): a thin marker
                w = span / 500
            ax.broken_barh([(a0, w)], (y - 0.4, 0.68 if a.is_compute else 0.68),
                           facecolors=colour, edgecolor="white", linewidth=0.6)
            if a.is_compute and a.version >= 1 and w * inch_per_unit >= 0.45:
                text += "v1"
            need = (len(text) * 0.6 + 0.4) * fontsize / 72
            if text and w * inch_per_unit >= need:
                ax.text(a0 + w / 2, y - 0.06, text, ha="center", va="center",
                        fontsize=fontsize, color="white" if _dark(acts) else "black")
            elif a.kind == A.STEP:  # too narrow: the step's batch above the block
                ax.text(a0 + w / 2, y - 0.43, text, ha="center", va="bottom",
                        fontsize=fontsize - 1, color=COLOURS["S"])
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([name for name, _ in rows])
    ax.set_ylim(len(rows) - 0.45, -0.6)
    ax.set_xlim(*(xlim or (start, end)))
    ax.set_xlabel(unit)
    ax.set_title(title, fontsize=9, loc="left")
    ax.grid(axis="x", alpha=0.25)
    legend = [Patch(color=COLOURS[k], label=label) for k, label in legend_entries(drawn)]
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(0, -0.9 / height - 0.02),
              ncol=8, fontsize=8, frameon=False)
    fig.tight_layout()
    return fig


def _dark(acts) -> bool:
    a = acts[0]
    key = (a.kind, min(a.version, 1)) if a.is_compute else a.kind
    return key in DARK


def parse_args(argv=None):
    p = FiniteParser(description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_argument_group("simulated schedule")
    src.add_argument("--schedule", choices=schedule_names(), default=DEFAULT_SCHEDULE)
    src.add_argument("--pipeline-stages", "-d", type=int, default=4)
    src.add_argument("--num-microbatches", "-m", type=int, default=8)
    src.add_argument("--batches", type=int, default=2)
    src.add_argument("--gpipe-microbatches-per-flush", type=int, default=None, metavar="K",
                     help="gpipe: each batch in flushes of at most K microbatches")
    src.add_argument("--durations", default=None, help="e.g. F=1,B=2,S=0.5,R=0,N=0.2")
    src.add_argument("--comm-latency", type=float, default=0.0)
    src.add_argument("--model", default=None,
                     help="durations from the planner's cost model for this named model "
                          "(e.g. gpt-1.3b)")
    src.add_argument("--micro-batch-size", type=int, default=1)
    src.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="bf16")
    src.add_argument("--profile", default=None, help="profile JSON (tools/plan.py --profile-out)")
    src.add_argument("--print", action="store_true", help="print the text grid too")
    p.add_argument("--trace", default=None,
                   help="engine trace prefix: reads PREFIX.rank*.json (pretrain_gpt.py --trace)")
    p.add_argument("--skip-windows", type=int, default=0,
                   help="with --trace: leave out each rank's first K batches (warm-up)")
    p.add_argument("--window", default=None, help="START:END: draw only this time range")
    p.add_argument("--out", "-o", default=None, help="output PNG (default: a descriptive name)")
    args = p.parse_args(argv)
    if args.trace is None:
        if args.pipeline_stages < 1 or args.num_microbatches < 1 or args.batches < 1:
            p.error("-d, -m and --batches must be >= 1")
        try:
            kind = _kind(args)
        except ValueError as e:
            p.error(str(e))
        error = kind.microbatch_error(args.pipeline_stages, args.num_microbatches,
                                      "raise -m or lower -d")
        if error:
            p.error(error)
    if args.window:
        try:
            lo, hi = (finite_float(x) for x in args.window.split(":"))
            args.window = (lo, hi)
        except (ValueError, argparse.ArgumentTypeError):
            p.error("--window takes START:END, two finite numbers")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.trace:
        rows, unit, title = traced(args.trace, args.skip_windows)
        out = args.out or f"{args.trace}.png"
    else:
        rows, unit, title = simulated(args)
        out = args.out or (f"schedule_{args.schedule}_d{args.pipeline_stages}_"
                           f"m{args.num_microbatches}.png")
    draw(rows, unit, title, out, args.window)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
