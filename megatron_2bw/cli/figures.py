"""The README's pictures, drawn by the project's own tools (one command, from the checkout):

    python tools/make_figures.py                            # docs/img/*.png, about 2 minutes
    python tools/make_figures.py --out-dir figs --convergence-iters 300

- timelines.png: 2BW, PipeDream-Flush and GPipe at d=4, m=8, two batches, simulated with the
  unit durations F=1, B=2, S=0.5 on one time scale (plot_schedule.py: the engine's own tables);
- convergence.png: 2bw, 2bw+predict-spike (compensated) and gpipe on the README's model and
  data (compare_convergence.py; a short run: --convergence-iters, default 100);
- memory.png: memory per stage for each schedule from the planner's memory model
  (planner/cost_model.py, which bench/memory.py checks against the engine's buffers to the
  byte) for GPT-1.3B, bf16, d=4, m=8, micro batch 1.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

from megatron_2bw.cli import compare_convergence, plot_schedule
from megatron_2bw.config.numbers import FiniteParser
from megatron_2bw.fs import atomic_write_bytes
from megatron_2bw.schedule.kinds import schedule_names

SCHEDULES = tuple(schedule_names())  # every training schedule, the registry's order
CONVERGENCE_RUNS = "2bw,2bw+predict-spike,gpipe"
MEMORY_MODEL, MEMORY_LAYOUT = "gpt-1.3b", {"pipeline": 4, "micro_batch": 1, "microbatches": 8}
PARTS = (("weights", "weights (bf16; 2BW: two versions)", "#3182bd"),
         ("master", "fp32 master weights", "#9ecae1"),
         ("grads", "gradient buffers", "#e6550d"), ("model_grad", "bf16 gradient", "#fdae6b"),
         ("optimizer", "Adam moments", "#31a354"), ("activations", "activation stash", "#756bb1"))


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def timelines(path: str) -> str:
    plt = _pyplot()
    sims = [plot_schedule.simulated(plot_schedule.parse_args(
        ["--schedule", s, "-d", "4", "-m", "8", "--batches", "2"])) for s in SCHEDULES]
    end = max(e[1] for rows, _, _ in sims for _, ev in rows for e in ev)
    fig, axes = plt.subplots(len(sims), 1, figsize=(15, 3.4 * len(sims)))
    for ax, (rows, unit, title) in zip(axes, sims):
        plot_schedule.figure(rows, unit, title, ax=ax, xlim=(0, end))
    fig.subplots_adjust(hspace=0.9)
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return path


def memory_per_stage() -> dict:
    """schedule -> per stage {part: GiB} from the planner's memory model."""
    from megatron_2bw.models.flops import named_model
    from megatron_2bw.planner import AnalyticProfile, Layout, Setup, Topology
    from megatron_2bw.planner.cost_model import LayerTimes, stage_plan
    setup = Setup(named_model(MEMORY_MODEL), "bf16", "adam")
    L = MEMORY_LAYOUT
    topo = Topology(num_nodes=1, gpus_per_node=L["pipeline"])
    out = {}
    for s in SCHEDULES:
        plan = stage_plan(setup, Layout(s, 1, L["pipeline"], 1, L["micro_batch"],
                                        L["microbatches"]),
                          LayerTimes(setup, AnalyticProfile(), topo), topo)
        out[s] = [{k: v / 2 ** 30 for k, v in m.items()} for m in plan.memory]
    return out


def memory(path: str) -> str:
    plt = _pyplot()
    per = memory_per_stage()
    fig, axes = plt.subplots(1, len(per), figsize=(13, 4.6), sharey=True)
    for ax, (schedule, stages) in zip(axes, per.items()):
        xs = range(len(stages))
        bottom = [0.0] * len(stages)
        for key, label, colour in PARTS:
            ys = [st.get(key, 0.0) for st in stages]
            ax.bar(xs, ys, bottom=bottom, color=colour, label=label, width=0.7)
            bottom = [b + y for b, y in zip(bottom, ys)]
        for x, st in zip(xs, stages):
            ax.text(x, st["total"], f"{st['total']:.1f}", ha="center", va="bottom", fontsize=8)
        ax.set_title(schedule)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([f"stage {x}" for x in xs])
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("GiB per GPU")
    L = MEMORY_LAYOUT
    fig.suptitle(f"memory per stage, the planner's model: {MEMORY_MODEL}, bf16, Adam, "
                 f"d={L['pipeline']}, m={L['microbatches']}, micro batch {L['micro_batch']}",
                 fontsize=10)
    axes[-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def convergence(path: str, iters: int, tiny: bool) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        rc = compare_convergence.main(["--schedules", CONVERGENCE_RUNS, "--train-iters",
                                       str(iters), "--out-dir", tmp]
                                      + (["--tiny"] if tiny else []))
        if rc != 0:
            raise SystemExit(f"make_figures: compare_convergence exited {rc}")
        with open(os.path.join(tmp, "convergence.png"), "rb") as f:
            atomic_write_bytes(path, f.read())
    return path


def main(argv=None) -> int:
    p = FiniteParser(description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default=os.path.join("docs", "img"))
    p.add_argument("--convergence-iters", type=int, default=100,
                   help="iterations of each convergence run (default %(default)s)")
    p.add_argument("--tiny", action="store_true",
                   help="convergence on compare_convergence's tiny model (a smoke run: tests)")
    p.add_argument("--only", choices=("timelines", "convergence", "memory"), action="append",
                   help="draw only these (repeatable; default: all)")
    a = p.parse_args(argv)
    if a.convergence_iters < 10:
        p.error("--convergence-iters must be >= 10 (the runs evaluate every 10%)")
    if not os.path.isdir(a.out_dir):
        p.error(f"--out-dir {a.out_dir}: no such directory: create it or run from the checkout")
    which = a.only or ["timelines", "convergence", "memory"]
    out = lambda name: os.path.join(a.out_dir, f"{name}.png")  # noqa: E731
    if "timelines" in which:
        print(f"wrote {timelines(out('timelines'))}")
    if "memory" in which:
        print(f"wrote {memory(out('memory'))}")
    if "convergence" in which:
        print(f"wrote {convergence(out('convergence'), a.convergence_iters, a.tiny)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
