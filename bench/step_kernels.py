"""What a 2BW stage's optimizer step costs per batch, with and without the staleness compensation,
per kernel: `python bench/step_kernels.py [--numel 8400000] [--repeats 15]`.

One process, one thread (as the launcher runs a rank), flat fp32 buffers of a stage's size
(default: bench/peers.py's small-compute shape, 8.4 M parameters per stage), weight decay on
70% of them. Each row is the work the engine does once per batch and stage on a CPU:

    2bw (plain)          the step from the version a batch ran on into the other slot
    2bw+predict ...      the step in place on the master, then what the compensation writes
                         into the slot (optim/optimizer.py: in the step's pass for the native
                         kernel, `predict_chunks` after it for torch's)

Rows are timed interleaved (one call of each per round, median over rounds), and each is printed
as a ratio to plain 2bw with the same kernel and to plain 2bw with torch's fused kernel (the
engine's default, `--optimizer-impl auto`; the native kernel runs with `--optimizer-impl native`).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from megatron_2bw.config import OptimizerConfig
from megatron_2bw.optim import native
from megatron_2bw.optim import optimizer as O
from megatron_2bw.optim.kernels import choose_impl

METHODS = {"2bw": None, "2bw+predict": (False, False), "2bw+predict-spike": (False, True),
           "2bw+predict-nesterov": (True, False)}


def _work(impl: str, method: str, numel: int):
    """A closure doing one batch's step (+ compensation) with kernel `impl`."""
    cfg = OptimizerConfig(lr=1e-3, weight_decay=0.1, adam_beta2=0.95)
    mode = METHODS[method]
    opt = O.make_optimizer(cfg, numel, int(0.7 * numel), "cpu", impl=impl,
                           keep_grad=mode is not None and mode[0])
    gen = torch.Generator().manual_seed(0)
    src, grad = torch.randn(numel, generator=gen), torch.randn(numel, generator=gen) * 1e-3
    dst = torch.empty(numel)
    opt.step(src, grad, dst, 1e-3)  # moments not zero

    def plain():
        opt.step(src, grad, dst, 1e-3)

    def compensated():
        nesterov, spike = mode
        if opt.fuses_prediction(dst.dtype):
            opt.step(src, grad, src, 1e-9, predict=(dst, 1e-9, nesterov, spike))
        else:
            opt.step(src, grad, src, 1e-9)
            opt.predict(src, dst, 1e-9, nesterov=nesterov, spike=(grad, 1e-9) if spike else None)

    return plain if mode is None else compensated


def measure(numel: int, repeats: int) -> dict:
    torch.set_num_threads(1)
    impls = ["torch-fused"] + (["native"] if native.library() is not None else [])
    works = {(impl, m): _work(impl, m, numel) for impl in impls for m in METHODS}
    times = {key: [] for key in works}
    for _ in range(repeats + 1):  # the first round warms up
        for key, fn in works.items():
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
    ms = {key: 1e3 * statistics.median(ts[1:]) for key, ts in times.items()}
    base = ms[("torch-fused", "2bw")]
    rows = [{"kernel": impl, "run": m, "ms": round(ms[(impl, m)], 2),
             "vs_plain_same_kernel": round(ms[(impl, m)] / ms[(impl, "2bw")], 3),
             "vs_plain_torch_fused": round(ms[(impl, m)] / base, 3)}
            for impl, m in works]
    return {"numel": numel, "repeats": repeats, "rows": rows}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=8_400_000)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args(argv)
    if args.numel < 1 or args.repeats < 1:
        ap.error("--numel and --repeats must be positive")
    out = measure(args.numel, args.repeats)
    print(f"default kernel here (--optimizer-impl auto): {choose_impl('cpu', 'adam')}")
    print(f"{'kernel':12s} {'run':22s} {'ms':>8s} {'/plain(same)':>13s} {'/plain(torch)':>14s}")
    for r in out["rows"]:
        print(f"{r['kernel']:12s} {r['run']:22s} {r['ms']:8.2f} {r['vs_plain_same_kernel']:13.3f}"
              f" {r['vs_plain_torch_fused']:14.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
