"""The plots' words and marks, read back from the figures' artists: the timeline's title gives
the steady-state bubble (fill and drain named as such), its legend lists only what occurs, long
runs get an automatic steady-state window, and the convergence plot's legend and iteration
ticks are right for any number of iterations."""
import math
import re

import pytest

from megatron_2bw.cli import convergence_report as R
from megatron_2bw.cli import plot_schedule as P


def _timeline(*flags):
    rows, unit, title = P.simulated(P.parse_args(list(flags)))
    fig = P.figure(rows, unit, title)
    ax = fig.axes[0]
    return fig, ax.get_title(loc="left"), [t.get_text() for t in ax.get_legend().get_texts()]


def _percent(pattern, text):
    m = re.search(pattern + r" ([0-9.]+)%", text)
    assert m, (pattern, text)
    return float(m.group(1)) / 100


@pytest.mark.parametrize("schedule", ["2bw", "flush", "gpipe"])
def test_the_title_reports_the_steady_state_bubble_and_names_fill_and_drain(schedule):
    d, m, f, b, s = 4, 8, 1.0, 2.0, 0.5  # the default durations F=1, B=2, S=0.5
    _, title, _ = _timeline("--schedule", schedule, "-d", str(d), "-m", str(m), "--batches", "2")
    busy = m * (f + b) + s
    # 2BW never flushes: its steady state has no bubble; flush and gpipe refill every batch
    period = busy if schedule == "2bw" else busy + (d - 1) * (f + b)
    assert math.isclose(_percent("steady-state bubble", title), 1 - busy / period, abs_tol=1e-3)
    idle = _percent("idle", title)
    assert "with fill and drain" in title and idle > 0.1  # 2bw: 15.5%, all of it fill/drain
    assert not re.search(r"(?<!steady-state )bubble 15\.5%", title)


def test_one_batch_has_no_steady_state_to_report():
    _, title, _ = _timeline("--schedule", "2bw", "-d", "2", "-m", "4", "--batches", "1")
    assert "steady-state bubble n/a" in title and "--batches 2+" in title


@pytest.mark.parametrize("schedule,versions", [("2bw", {"v0", "v1"}), ("flush", {"v0"}),
                                               ("gpipe", {"v0"})])
def test_the_legend_lists_only_what_occurs(schedule, versions):
    fig, _, legend = _timeline("--schedule", schedule, "-d", "4", "-m", "8")
    assert {x.split()[-1] for x in legend if x.startswith(("forward", "backward"))} == versions
    ax = fig.axes[0]
    drawn = {tuple(c) for coll in ax.collections for c in coll.get_facecolor()}
    for handle, text in zip(ax.get_legend().legend_handles, legend):
        assert tuple(handle.get_facecolor()) in drawn, f"legend entry {text!r} is not drawn"


def test_a_long_run_gets_a_readable_steady_state_window():
    fig, title, _ = _timeline("--schedule", "2bw", "-d", "2", "-m", "4", "--batches", "10")
    width, height = fig.get_size_inches()
    assert "showing batches 2-3 of 10" in title and width / height <= 6, (width, height)
    ax = fig.axes[0]
    lo, hi = ax.get_xlim()
    period = 4 * 3.0 + 0.5  # m (F + B) + S: one 2BW batch in the steady state
    assert math.isclose(hi - lo, 2 * period, rel_tol=1e-6)
    # every compute block in the window is labelled with its microbatch
    labels = [t.get_text() for t in ax.texts]
    assert sum(x.rstrip("v1").isdigit() for x in labels) >= 2 * 2 * 4 * 2 - 4
    fig, title, _ = _timeline("--schedule", "2bw", "-d", "2", "-m", "4", "--batches", "3")
    assert "showing" not in title  # a short run is drawn whole


@pytest.mark.parametrize("iters", [5, 7, 60, 300])
def test_the_convergence_plot_says_what_it_smooths_and_ticks_whole_iterations(iters):
    curves = {run: [5.0 - 0.01 * i + 0.001 * k for i in range(iters)]
              for k, run in enumerate(("2bw", "gpipe"))}
    summary = R.summarize(curves, {}, {})
    fig = R.figure(curves, summary, "t", lambda run: 1 if run == "2bw" else 0)
    fig.canvas.draw()
    ax, bx = fig.axes[:2]
    legend_title = ax.get_legend().get_title().get_text()
    window, last = iters // 20, max(1, round(iters / 10))
    assert "over 1 iterations" not in legend_title
    if window > 1:
        assert f"moving average over {window} iterations" in legend_title
    else:
        assert "no moving average" in legend_title
        assert len(ax.lines) == len(curves)  # no raw curve under an identical smoothed one
    assert (f"mean of the last {last} iterations" if last > 1 else "the last iteration") \
        in legend_title
    for axis in (ax, bx):
        lo, hi = axis.get_xlim()
        ticks = [t for t in axis.get_xticks() if lo <= t <= hi]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_gpipe_in_flushes_is_drawn_with_one_fill_per_flush():
    """--gpipe-microbatches-per-flush K draws the engine's table: m / K fills per batch, K in
    flight; a K with another schedule is a one-line argparse error."""
    d, m, k, f, b, s = 4, 8, 2, 1.0, 2.0, 0.5
    _, title, _ = _timeline("--schedule", "gpipe", "-d", str(d), "-m", str(m), "--batches", "2",
                            "--gpipe-microbatches-per-flush", str(k))
    assert title.startswith(f"gpipe in flushes of {k}") and "peak in flight [2, 2, 2, 2]" in title
    busy = m * (f + b) + s
    period = busy + (m // k) * (d - 1) * (f + b)
    assert math.isclose(_percent("steady-state bubble", title), 1 - busy / period, abs_tol=1e-3)
    with pytest.raises(SystemExit):
        P.parse_args(["--schedule", "flush", "--gpipe-microbatches-per-flush", "2"])
