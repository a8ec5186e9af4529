#!/usr/bin/env python
"""The PipeDream-2BW paper's comparisons (Narayanan et al., ICML 2021, Section 5) through the planner.

    python bench/paper_table.py [--json FILE]

The paper's hardware, as it describes it: 8 AWS p3.16xlarge servers, 8 V100-16GB each over NVLink,
one 25 Gbit/s NIC per server shared by its 8 GPUs (`--nics-per-node 1 --nic-bandwidth-gbps 25`),
fp16, and the built-in V100 profile (planner/curve.py: its GEMM-efficiency curve by microbatch
size and its sources). GPT runs at the paper's sequence length, 512 (`PAPER_SEQ_LENGTH`). Every ratio takes each technique at its best layout in the paper's space
(no tensor parallelism unless the row is about it, no distributed optimizer, no sequence
parallelism; with or without recomputation): the planner's predicted samples/s, best / best.
Nothing here is tuned to the paper: the rows print the paper's number, the prediction and their
ratio; `within 25%` says whether |prediction / paper - 1| <= 0.25.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_2bw.models.flops import named_model, num_parameters  # noqa: E402
from megatron_2bw.planner.cost_model import LayerTimes, Setup, stage_plan  # noqa: E402
from megatron_2bw.planner.profile import AnalyticProfile  # noqa: E402
from megatron_2bw.planner.search import enumerate_layouts, search  # noqa: E402
from megatron_2bw.planner.topology import GB, PlanError, Topology  # noqa: E402

HARDWARE = dict(num_nodes=8, gpus_per_node=8, gpu_memory_gb=16, intra_node_bandwidth_gbps=1200,
                inter_node_bandwidth_gbps=25, nics_per_node=1, nic_bandwidth_gbps=25)
# The paper's code (github.com/msr-fiddle/pipedream, megatron/: Megatron-LM of 2020 with the
# 2BW and GPipe schedules) all-reduces the fp16 gradients (its `--fp32-allreduce` is off unless
# given), 2 bytes per element where this engine's fp32 buffers move 4.
GRAD_REDUCE_BYTES = 2.0
# the speed rows compare the paper's 2BW, a gradient buffer per weight version (one_buffer=False:
# no --2bw-grad-buffers first/1 fallback, which would let our 2BW fit layouts the paper's did
# not); the largest-model row is our engine's capacity and allows them (`largest_trainable`)
SPACE = dict(dtype="fp16", tensor_sizes=(1,), distributed_optimizer=(False,),
             sequence_parallel=(False,), recompute=(False, True), top_k=1,
             grad_reduce_bytes=GRAD_REDUCE_BYTES, one_buffer=False)
PROFILE = AnalyticProfile.for_device("v100")
# The paper's throughput experiments run GPT at sequence length 512 (Sec. 5.2: the throughputs
# "using 8 and 64 V100s with a sequence length of 512"); models/flavours.py's GPT shapes carry
# 2048, the GPT-3 convention. Activations and the logits (s x V per sample) scale with it, so it
# decides which layouts fit (GPipe's above all) and how compute weighs against the NIC.
PAPER_SEQ_LENGTH = 512
_CACHE: dict = {}
_WHY: dict = {}  # schedules -> why nothing fitted (the planner's one line)


def paper_model(name: str):
    """The named model at the paper's sequence length (GPT; BERT keeps its 512)."""
    model = named_model(name)
    if name.startswith("gpt"):
        model = replace(model, seq_length=PAPER_SEQ_LENGTH, max_position_embeddings=None)
    return model


def best(model_name: str, batch: int, schedules, topo=None, **kw):
    """The best Estimate of `schedules` (None: nothing fits)."""
    key = (model_name, batch, tuple(schedules), json.dumps(kw, sort_keys=True, default=str),
           id(topo))
    if key not in _CACHE:
        args = dict(SPACE, **kw)
        try:
            _CACHE[key] = search(paper_model(model_name), topo or Topology(**HARDWARE), PROFILE,
                                 batch, schedules=tuple(schedules), **args).best
        except PlanError as e:
            _CACHE[key] = None
            why = str(e).split(":")[1].strip() if ":" in str(e) else str(e)
            _WHY.setdefault(tuple(schedules), f"{why} at {model_name} B={batch}")  # the first
    return _CACHE[key]


def ratio(a, b) -> float | None:
    return None if a is None or b is None else a.samples_per_s / b.samples_per_s


def tensor_only(model_name: str, batch: int, t: int):
    """Tensor model parallelism alone over t GPUs (no pipelining), replicated w = 64 / t times;
    t = 16 spans two servers: its all-reduces run over the servers' shared NIC."""
    model = paper_model(model_name)
    if t <= HARDWARE["gpus_per_node"]:
        return best(model_name, batch, ("flush",), tensor_sizes=(t,), pipeline_sizes=(1,))
    key = ("tensor16", model_name, batch)
    if key not in _CACHE:
        try:
            _CACHE[key] = search(model, two_server_topology(), PROFILE, batch,
                                 schedules=("flush",),
                                 **dict(SPACE, tensor_sizes=(t,), pipeline_sizes=(1,))).best
        except PlanError:
            _CACHE[key] = None
    return _CACHE[key]


def two_server_topology() -> Topology:
    """Pairs of servers as 16-GPU "nodes", for one 16-way tensor group per pair. A ring
    all-reduce over the 16 ranks crosses from one server to the other once per direction: of
    its 2(n-1)/n x S per link, the NIC carries one link's share, like every NVLink hop, so the
    ring runs at the NIC's full 25 Gbit/s (not an eighth of it: the 8 GPUs of a server do not
    each send over the NIC) and each of its 2(n-1) steps waits for the slowest hop, the NIC's
    latency. The pair has two NICs for the data-parallel all-reduces that leave it (the flows
    its 16 groups send share them: placement.py)."""
    h = HARDWARE
    return Topology(**dict(h, num_nodes=h["num_nodes"] // 2, gpus_per_node=2 * h["gpus_per_node"],
                           intra_node_bandwidth_gbps=h["nic_bandwidth_gbps"],
                           intra_node_latency_us=Topology().inter_node_latency_us,
                           nics_per_node=2 * h["nics_per_node"]))


class _Sequential:
    """An estimate of inter-layer model parallelism without pipelining: the m microbatches go
    through the d stages one at a time (a stage works only while the microbatch is on it)."""

    def __init__(self, plan):
        d, m = plan.layout.pipeline, plan.layout.num_microbatches
        one = sum(plan.fwd[s] + plan.bwd[s] for s in range(d)) + 2 * sum(plan.p2p)
        self.layout, self.plan = plan.layout, plan
        self.time_per_batch = m * one + max(plan.norm[s] + plan.step[s] for s in range(d))
        self.samples_per_s = plan.layout.global_batch / self.time_per_batch


def no_pipelining(model_name: str, batch: int):
    """The fastest sequential layout (d > 1) whose flush memory fits (an upper bound of its own:
    one microbatch in flight needs no more than 1F1B's min(d - s, m))."""
    key = ("sequential", model_name, batch)
    if key not in _CACHE:
        model, topo = paper_model(model_name), Topology(**HARDWARE)
        setup = Setup(model, "fp16", grad_reduce_bytes=GRAD_REDUCE_BYTES)
        times = LayerTimes(setup, PROFILE, topo)
        found = None
        for layout in enumerate_layouts(model, topo, batch, ("flush",), (False, True), (1,),
                                        distributed_optimizer=(False,),
                                        sequence_parallel=(False,)):
            if layout.pipeline == 1:
                continue
            plan = stage_plan(setup, layout, times, topo)
            if plan.max_memory <= topo.usable_memory_gb * GB:
                est = _Sequential(plan)
                if found is None or est.samples_per_s > found.samples_per_s:
                    found = est
        _CACHE[key] = found
    return _CACHE[key]


def up_to(pairs, baseline=("gpipe",)):
    vals = [(r, what) for r, what in pairs if r is not None]
    return max(vals) if vals else (None, f"{baseline[0]} does not fit: {_WHY.get(baseline)}")


def rows() -> list:
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
    out.append(("2BW vs tensor MP t=8 in one server, GPT-2.2B", 1.3,
                ratio(best("gpt-2.2b", 512, ("2bw",)), tensor_only("gpt-2.2b", 512, 8)),
                "gpt-2.2b B=512"))
    out.append(("2BW vs tensor MP t=16 over two servers, GPT-3.8B", 20.0,
                ratio(best("gpt-3.8b", 512, ("2bw",)), tensor_only("gpt-3.8b", 512, 16)),
                "gpt-3.8b B=512"))
    r, what = up_to((ratio(best(m, B, ("2bw",)), no_pipelining(m, B)), f"{m} B={B}")
                    for m in gpts for B in (512, 2048))
    out.append(("2BW vs inter-layer MP (no pipelining), up to", 6.1, r, what))
    return out


# GPT shapes (heads of 128), deep ones too: a deeper model splits over more stages (d <= layers)
SHAPES = tuple((layers, hidden) for layers in (32, 40, 48, 64, 80, 96, 128)
               for hidden in (4096, 5120, 6144, 7168, 8192))


def largest_trainable(batch: int = 2048) -> tuple | None:
    """The largest GPT of `SHAPES` that 2BW fits on the 64 GPUs (recomputation and every
    pipeline depth allowed; whether it fits, not how fast: `search(fit_only=True)`), with its
    parameters, shape and a layout that fits."""
    def shaped(layers, hidden):
        return replace(paper_model("gpt-2.2b"), num_layers=layers, hidden_size=hidden,
                       num_attention_heads=hidden // 128, ffn_hidden_size=4 * hidden)
    for layers, hidden in sorted(SHAPES, key=lambda s: -num_parameters(shaped(*s))):
        model = shaped(layers, hidden)
        try:
            est = search(model, Topology(**HARDWARE), PROFILE, batch, schedules=("2bw",),
                         fit_only=True, **dict(SPACE, recompute=(True,), one_buffer=True)).best
        except PlanError:
            continue
        return num_parameters(model), layers, hidden, est
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    t0 = time.process_time()
    table = rows()
    lines = ["| comparison | paper | predicted | predicted / paper | within 25% | case |",
             "|---|---|---|---|---|---|"]
    results = []
    for name, paper, pred, what in table:
        rel = None if pred is None else pred / paper
        ok = rel is not None and abs(rel - 1) <= 0.25
        lines.append(f"| {name} | {paper:g}x | "
                     f"{'n/a' if pred is None else f'{pred:.2f}x'} | "
                     f"{'n/a' if rel is None else f'{rel:.2f}'} | {'yes' if ok else 'NO'} | "
                     f"{what} |")
        results.append(dict(comparison=name, paper=paper, predicted=pred, within_25=ok,
                            case=what))
    print("\n".join(lines))
    print("\npicks (paper space, B=512):")
    picks = {}
    for m in ("gpt-2.2b", "gpt-3.8b"):
        e = best(m, 512, ("2bw",))
        picks[m] = e.layout.describe()
        print(f"  {m}: {e.layout.describe()}  {e.samples_per_s:.4g} samples/s predicted, "
              f"max {max(e.memory_gb):.2f} GB")
    big = largest_trainable()
    if big:
        n, layers, hidden, est = big
        print(f"\nlargest GPT 2BW trains on 64 16-GB GPUs: {n / 1e9:.1f}B parameters ({layers} "
              f"layers x hidden {hidden}; {est.layout.describe()}; paper: almost 30B)")
    print(f"\n{time.process_time() - t0:.1f} s CPU")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": results, "picks": picks,
                       "largest_b": big[0] / 1e9 if big else None}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
