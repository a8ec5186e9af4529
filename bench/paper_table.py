#!/usr/bin/env python
"""The PipeDream-2BW paper's comparisons (Narayanan et al., ICML 2021, Section 5) through the planner.

    python bench/paper_table.py [--json FILE] [--usable-gb G] [--sensitivity] [--nic-gbps G]

The paper's hardware, as it describes it: 8 AWS p3.16xlarge servers, 8 V100-16GB each over NVLink,
one 25 Gbit/s NIC per server shared by its 8 GPUs (`--nics-per-node 1 --nic-bandwidth-gbps 25`),
fp16, and the built-in V100 profile (planner/curve.py: its GEMM-efficiency curve by microbatch
size and its sources). Its stack as its code has it (bench/paper_memory.py): GPT at sequence
length 512, fp16 gradient all-reduce, attention without FlashAttention; the memory it could use
is the middle of the interval the paper's own fit / out-of-memory observations leave in this
project's accounting (`--usable-gb` another; `--sensitivity` the rows at the interval's ends).
`--nic-gbps` prices the servers' NICs at another rate than their 25 Gbit/s line rate.

First the paper's configurations (Sec. 5.2, `paper_config_rows`), then each technique at its best
layout in the paper's space (`best_layout_rows`). Nothing here is tuned to the paper's ratios:
the rows print the paper's number, the prediction and their ratio; `within 25%` says whether
|prediction / paper - 1| <= 0.25.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_2bw.models.flops import num_parameters  # noqa: E402
from megatron_2bw.planner.search import divisors, search  # noqa: E402
from megatron_2bw.planner.topology import PlanError, Topology  # noqa: E402
from paper_memory import usable_interval  # noqa: E402
from paper_space import (HARDWARE, PROFILE, SPACE, _topology, best, no_pipelining,  # noqa: E402
                         paper_model, ratio, set_nic, set_usable, tensor_only,
                         two_server_topology, up_to)

__all__ = ["HARDWARE", "PROFILE", "paper_model", "two_server_topology", "main"]


def best_layout_rows() -> list:
    """Each technique at its best layout in the paper's space (the issue's first reading)."""
    gpts = ("gpt-2.2b", "gpt-3.8b")
    out = []
    r, what = up_to((ratio(best(m, B, ("2bw",)), best(m, B, ("gpipe",))), f"{m} B={B}")
                    for m in gpts for B in (512, 2048))
    out.append(("2BW vs GPipe, up to", 3.2, r, what))
    for B, paper in ((512, 2.1), (2048, 3.0)):
        r, what = up_to((ratio(best(m, B, ("flush",)), best(m, B, ("gpipe",))), f"{m} B={B}")
                        for m in gpts)
        out.append((f"Flush vs GPipe, B={B}", paper, r, what))
    for B, paper in ((512, 1.6), (2048, 1.15)):
        r, what = up_to((ratio(best(m, B, ("2bw",)), best(m, B, ("flush",))), f"{m} B={B}")
                        for m in gpts)
        out.append((f"2BW vs Flush, B={B}", paper, r, what))
    one = _topology(1)  # "On a single node" (Sec. 5.2; Fig. 6a: B=64, 256)
    out.append((T8_ROW, 1.3) + up_to(
        (ratio(best("gpt-2.2b", B, ("2bw",), one, key=1), tensor_only("gpt-2.2b", B, 8, 1)),
         f"gpt-2.2b 8 GPUs B={B}") for B in (64, 256)))
    out.append((T16_ROW, 20.0) + up_to(
        (ratio(best("gpt-3.8b", B, ("2bw",)), tensor_only("gpt-3.8b", B, 16)), f"gpt-3.8b B={B}")
        for B in (512, 2048)))
    # every inter-layer number of the paper is on GPT-2.2B (`over_inter_layer`)
    r, what = up_to(
        [(ratio(best("gpt-2.2b", B, ("2bw",), one, key=1), no_pipelining("gpt-2.2b", B, 1)),
          f"gpt-2.2b 8 GPUs B={B}") for B in (64, 256)]
        + [(ratio(best("gpt-2.2b", B, ("2bw",)), no_pipelining("gpt-2.2b", B)),
            f"gpt-2.2b B={B}") for B in (512, 2048)])
    out.append(("2BW vs inter-layer MP (no pipelining), up to", 6.1, r, what))
    return out


T8_ROW = "2BW vs tensor MP t=8 in one server, GPT-2.2B"
T16_ROW = "2BW vs tensor MP t=16 over two servers, GPT-3.8B"

# ---- the paper's configurations (Sec. 5.2) ---------------------------------------------------
# "In these experiments, we use activation recomputation, and the largest per-GPU microbatch size
# that fits on the 16-GB V100 GPUs. We use the best configuration recommended by PipeDream-2BW's
# planner for all comparisons: 8-deep configurations for the model with 2.2 billion parameters,
# and 16-deep configurations for the model with 3.8 billion parameters." Fig. 6's panels: GPT-2.2B
# on one server (B=64, 256) and on 64 GPUs (B=512, 2048), GPT-3.8B on 64 GPUs (B=512, 2048), each
# "8-way" / "16-way model parallelism". Pipelines run m = d*g microbatches, and the larger batch
# is "more gradient accumulation" (Sec. 5.2): one microbatch size per panel, the largest that
# fits 2BW at the smaller batch, for 2BW, Flush and GPipe alike; GPipe runs its batch in flushes
# of the most microbatches that fit (Sec. 5.2: "the maximum number of microbatches it can admit
# is small"). Without pipelining (tensor MP over the d GPUs, inter-layer MP over d stages) the
# largest microbatch that fits the batch.
DEPTH = {"gpt-2.2b": 8, "gpt-3.8b": 16}
PANELS = (("gpt-2.2b", 1, (64, 256)), ("gpt-2.2b", 8, (512, 2048)), ("gpt-3.8b", 8, (512, 2048)))
RECOMPUTE = dict(SPACE, recompute=(True,))


def configured(model_name: str, nodes: int, batch: int, schedule: str, b: int):
    """The estimate of `schedule` at the panel's configuration (d, w = GPUs / d, b,
    recomputation; None when it does not fit)."""
    return best(model_name, batch, (schedule,), _topology(nodes), key=("nodes", nodes),
                **dict(RECOMPUTE, pipeline_sizes=(DEPTH[model_name],), micro_batches=(b,)))


def panel_micro_batch(model_name: str, nodes: int, small_batch: int) -> int | None:
    """The largest b (m = d*g microbatches of the smaller batch) at which 2BW fits."""
    d = DEPTH[model_name]
    w = nodes * HARDWARE["gpus_per_node"] // d
    fits = [b for b in divisors(small_batch // (w * d))
            if configured(model_name, nodes, small_batch, "2bw", b)]
    return max(fits, default=None)


def unpipelined(model_name: str, nodes: int, batch: int, tensor: bool):
    """Tensor MP over d GPUs (t = d; over two servers when d = 16) or inter-layer MP over d
    stages, replicated over the rest, recomputation, the largest microbatch that fits."""
    d = DEPTH[model_name]
    for b in sorted(divisors(batch // (nodes * HARDWARE["gpus_per_node"] // d)), reverse=True):
        kw = dict(recompute=(True,), micro_batches=(b,))
        found = tensor_only(model_name, batch, d, nodes, **kw) if tensor else \
            no_pipelining(model_name, batch, nodes, pipeline_sizes=(d,), **kw)
        if found is not None:
            return found
    return None


def panel_cases():
    """(model, nodes, batch, is the panel's larger batch, b) of every Fig. 6 case."""
    for model_name, nodes, batches in PANELS:
        b = panel_micro_batch(model_name, nodes, batches[0])
        for i, batch in enumerate(batches):
            yield model_name, nodes, batch, i == 1, b


def _case(model_name, nodes, batch, b, extra=""):
    return f"{model_name} {nodes * 8} GPUs B={batch} b={b}{extra}"


def paper_config_rows() -> list:
    """The eight comparisons at the paper's configurations (the comment above)."""
    cases = list(panel_cases())

    def pair(a, z, when=lambda c: True):
        return up_to((ratio(configured(c[0], c[1], c[2], a, c[4]),
                            configured(c[0], c[1], c[2], z, c[4])),
                      _case(c[0], c[1], c[2], c[4], _flushes(c, z)))
                     for c in cases if when(c))
    big = [c for c in cases if c[1] == 8]
    out = [("2BW vs GPipe, up to", 3.2) + pair("2bw", "gpipe")]
    for B, paper in ((512, 2.1), (2048, 3.0)):
        out.append((f"Flush vs GPipe, B={B}", paper) + pair(
            "flush", "gpipe", lambda c, B=B: c in big and c[2] == B))
    for B, paper in ((512, 1.6), (2048, 1.15)):
        out.append((f"2BW vs Flush, B={B}", paper) + pair(
            "2bw", "flush", lambda c, B=B: c in big and c[2] == B))
    for row, paper, model_name, nodes in ((T8_ROW, 1.3, "gpt-2.2b", 1),
                                          (T16_ROW, 20.0, "gpt-3.8b", 8)):
        out.append((row, paper) + up_to(
            (ratio(configured(c[0], c[1], c[2], "2bw", c[4]), unpipelined(c[0], c[1], c[2], True)),
             _case(c[0], c[1], c[2], c[4], _unpipelined_b(c, True)))
            for c in cases if c[0] == model_name and c[1] == nodes))
    out.append(("2BW vs inter-layer MP (no pipelining), up to", 6.1) + over_inter_layer(
        cases, "2bw"))
    return out


def over_inter_layer(cases, schedule, when=lambda c: True) -> tuple:
    """(the largest ratio of `schedule` over inter-layer MP, its case) on GPT-2.2B: every
    inter-layer number of the paper is on it (Sec. 5.2: "Compared to inter-layer MP, pipelining
    with flushes increases throughput by up to 4.1x for small batch sizes, and by up to 5.3x for
    large batch sizes, on the 2.2-billion model. 2BW is up to 6.1x faster than inter-layer MP":
    6.1 = 5.3 x 1.15, 2BW over Flush at the large batch). GPT-3.8B's 16 stages keep one GPU of
    16 busy, far beyond 6.1x (printed below the table)."""
    return up_to((ratio(configured(c[0], c[1], c[2], schedule, c[4]),
                        unpipelined(c[0], c[1], c[2], False)),
                  _case(c[0], c[1], c[2], c[4], _unpipelined_b(c, False)))
                 for c in cases if c[0] == "gpt-2.2b" and when(c))


def extra_rows() -> list:
    """The paper's other inter-layer numbers (Sec. 5.2), not in issue 30's table."""
    cases = list(panel_cases())
    return [("Flush vs inter-layer MP, small batch, GPT-2.2B, up to", 4.1)
            + over_inter_layer(cases, "flush", lambda c: not c[3]),
            ("Flush vs inter-layer MP, large batch, GPT-2.2B, up to", 5.3)
            + over_inter_layer(cases, "flush", lambda c: c[3])]


def gpt_38b_over_inter_layer() -> str:
    c = [c for c in panel_cases() if c[0] == "gpt-3.8b"]
    r, what = up_to((ratio(configured(x[0], x[1], x[2], "2bw", x[4]),
                           unpipelined(x[0], x[1], x[2], False)), _case(*x[:3], x[4])) for x in c)
    return f"2BW vs inter-layer MP on GPT-3.8B (d=16), up to {r:.2f}x ({what})"


def _flushes(case, schedule) -> str:
    est = configured(case[0], case[1], case[2], schedule, case[4])
    k = est and est.layout.microbatches_per_flush
    return f", gpipe in flushes of {k}" if k else ""


def _unpipelined_b(case, tensor) -> str:
    est = unpipelined(case[0], case[1], case[2], tensor)
    return f", {'tensor' if tensor else 'inter-layer'} b={est.layout.micro_batch}" if est else ""


# GPT shapes (heads of 128), deep ones too: a deeper model splits over more stages (d <= layers),
# and layer counts 2 short of a multiple of 32, which fill 32 or 64 stages evenly when the
# embedding and the head each take a layer's place
SHAPES = tuple((layers, hidden) for layers in (30, 32, 40, 48, 62, 64, 80, 94, 96, 126, 128)
               for hidden in (4096, 5120, 6144, 7168, 8192))


LARGEST_PAPER = 30.0  # Sec. 5.5: "models of up to almost 30 billion parameters using 64 16-GB GPUs"


def largest_trainable(batch: int = 2048) -> tuple | None:
    """The largest GPT of `SHAPES` that 2BW fits on the 64 GPUs (recomputation, every pipeline
    depth and partitions that fit allowed; whether it fits, not how fast:
    `search(fit_only=True)`), with its parameters, shape and a layout that fits."""
    def shaped(layers, hidden):
        return replace(paper_model("gpt-2.2b"), num_layers=layers, hidden_size=hidden,
                       num_attention_heads=hidden // 128, ffn_hidden_size=4 * hidden)
    for layers, hidden in sorted(SHAPES, key=lambda s: -num_parameters(shaped(*s))):
        model = shaped(layers, hidden)
        try:
            est = search(model, Topology(**HARDWARE), PROFILE, batch, schedules=("2bw",),
                         fit_only=True, **dict(SPACE, recompute=(True,), one_buffer=True,
                                               fit_partition=True)).best
        except PlanError:
            continue
        return num_parameters(model), layers, hidden, est
    return None


def _table(rows) -> tuple:
    lines = ["| comparison | paper | predicted | predicted / paper | within 25% | case |",
             "|---|---|---|---|---|---|"]
    results = []
    for name, paper, pred, what in rows:
        rel = None if pred is None else pred / paper
        ok = rel is not None and abs(rel - 1) <= 0.25
        lines.append(f"| {name} | {paper:g}x | "
                     f"{'n/a' if pred is None else f'{pred:.2f}x'} | "
                     f"{'n/a' if rel is None else f'{rel:.2f}'} | {'yes' if ok else 'NO'} | "
                     f"{what} |")
        results.append(dict(comparison=name, paper=paper, predicted=pred, within_25=ok,
                            case=what))
    return "\n".join(lines), results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    p.add_argument("--usable-gb", type=float, default=None,
                   help="GiB per GPU the stack may use (default: the middle of the interval "
                        "the paper's observations leave, bench/paper_memory.py)")
    p.add_argument("--nic-gbps", type=float, default=None,
                   help="Gbit/s each server's NIC moves (default: 25, its line rate)")
    p.add_argument("--sensitivity", action="store_true",
                   help="also the paper-configuration rows at the interval's two ends")
    a = p.parse_args(argv)
    if a.nic_gbps is not None and not a.nic_gbps > 0:
        p.error(f"--nic-gbps must be > 0, got {a.nic_gbps:g}")
    t0 = time.process_time()
    lo, hi = usable_interval()
    usable = a.usable_gb or (lo + hi) / 2
    if a.nic_gbps is not None:
        set_nic(a.nic_gbps)
        print(f"NICs at {a.nic_gbps:g} Gbit/s (line rate: 25)")
    set_usable(usable)
    print(f"usable memory per V100-16GB: {usable:.2f} GiB; the paper's fit / out-of-memory "
          f"observations leave {lo:.2f}-{hi:.2f} GiB (bench/paper_memory.py)\n")
    text, results = _table(paper_config_rows())
    print("The paper's configurations (Sec. 5.2: recomputation, d=8 for GPT-2.2B and d=16 for "
          "GPT-3.8B, the largest microbatch that fits):\n")
    print(text)
    text, extra = _table(extra_rows())
    print("\n" + "\n".join(text.splitlines()[2:]))
    print("\n" + gpt_38b_over_inter_layer())
    print("microbatch per panel:", ", ".join(
        f"{m} {n * 8} GPUs b={panel_micro_batch(m, n, bs[0])}" for m, n, bs in PANELS))
    text, best_results = _table(best_layout_rows())
    print("\nEach technique at its best layout in the paper's space (any d, with or without "
          "recomputation):\n")
    print(text)
    print("\npicks (paper space, B=512):")
    picks = {}
    for m in ("gpt-2.2b", "gpt-3.8b"):
        e = best(m, 512, ("2bw",))
        picks[m] = e.layout.describe()
        print(f"  {m}: {e.layout.describe()}  {e.samples_per_s:.4g} samples/s predicted, "
              f"max {max(e.memory_gb):.2f} GB")
    big = largest_trainable()
    big_ok = None
    if big:
        n, layers, hidden, est = big
        big_ok = abs(n / 1e9 / LARGEST_PAPER - 1) <= 0.25
        print(f"\n| largest GPT 2BW trains on 64 16-GB GPUs | almost {LARGEST_PAPER:g}B | "
              f"{n / 1e9:.1f}B | {n / 1e9 / LARGEST_PAPER:.2f} | {'yes' if big_ok else 'NO'} | "
              f"{layers} layers x hidden {hidden}; {est.layout.describe()}, stages "
              f"{est.plan.bounds[:3]}..{est.plan.bounds[-3:]} |")
    ends = {}
    if a.sensitivity:
        for end in (lo, hi - 1e-6):
            set_usable(end)
            ends[f"{end:.2f}"] = [r[2] for r in paper_config_rows()]
        print("\npaper-configuration rows at the interval's ends (usable GiB: predicted):")
        for i, r in enumerate(results):
            print(f"  {r['comparison']}: " + ", ".join(
                f"{k}: {'n/a' if v[i] is None else f'{v[i]:.2f}x'}" for k, v in ends.items()))
    print(f"\n{time.process_time() - t0:.1f} s CPU")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"usable_gb": usable, "usable_interval": [lo, hi],
                       "nic_gbps": HARDWARE["nic_bandwidth_gbps"], "rows": results,
                       "extra_rows": extra, "best_layout_rows": best_results, "picks": picks,
                       "largest_b": big[0] / 1e9 if big else None,
                       "largest_within_25": big_ok, "at_ends": ends}, f,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
