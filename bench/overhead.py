#!/usr/bin/env python
"""Engine overhead at d=1: our PipelineEngine vs a plain PyTorch training loop on the same model.

    python bench/overhead.py                      # GPT 4x256, seq 64, micro 4, m 8; 5 repeats
    python bench/overhead.py --breakdown          # also: the engine's fixed costs, one by one
    python bench/overhead.py --profile            # also: cProfile tables
    python bench/overhead.py --num-layers 2 --hidden-size 64 --seq-length 32 --batches 20 \
        --repeats 7 --breakdown                   # the small model (issue 16: 2bw within +8%)

In one spawned process (one thread) it builds the same GPT (megatron_2bw.models.gpt, mock data,
fp32) three times:

    plain        the whole model as one module, `(loss / m).backward()` per microbatch,
                 clip_grad_norm_, torch.optim.AdamW (param groups as the engine: decay on
                 matrices), zero_grad: what a user writes by hand
    engine-flush PipelineEngine with d=1 (schedule flush: one weight version)
    engine-2bw   PipelineEngine with d=1 (schedule 2bw: two weight versions, delayed update)

then times `--batches` batches of each, interleaved (plain, flush, 2bw, then rotated), for
`--repeats` rounds after a warm-up, and prints the median samples/s and the overhead
(plain rate / engine rate - 1; target: <= 5%, and the paired figure <= 8% on a small model).
The first three losses of every variant are compared with the plain loop (2bw: batch 0 only,
later batches differ by design). `--breakdown` measures the engine's fixed costs one by one
(seeding, dispatch, its own work per microbatch, receive buffers, the batch step and its
kernel, the DeepSpeed adapter, a p2p message and the handshake on two processes):
bench/overhead_breakdown.py.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402
import overhead_breakdown as OB  # noqa: E402
from megatron_2bw.schedule.kinds import DEFAULT_SCHEDULE, schedule_kind  # noqa: E402

VARIANTS = ("plain", "engine-flush", "engine-2bw")


def make_config(spec: dict, schedule: str, data: int = 1, **parallel):
    """The bench's GPT at d=1 on `data` replicas (`parallel`: more ParallelConfig fields)."""
    from megatron_2bw.config import (BatchConfig, Config, ModelConfig, OptimizerConfig,
                                     ParallelConfig, TrainConfig)
    b, m = spec["micro"], spec["m"]
    model = ModelConfig(num_layers=spec["layers"], hidden_size=spec["hidden"],
                        num_attention_heads=spec["heads"], seq_length=spec["seq"],
                        vocab_size=spec["vocab"], init_method_std=0.02)
    total = spec["warmup"] + spec["repeats"] * spec["batches"]
    return Config(model=model, schedule=schedule,
                  parallel=ParallelConfig(pipeline=1, data=data, **parallel),
                  batch=BatchConfig(micro_batch_size=b, global_batch_size=b * m * data),
                  optimizer=OptimizerConfig(lr=1e-4),
                  train=TrainConfig(train_iters=total, seed=1234)).validate(data)


class Plain:
    def __init__(self, cfg):
        import torch
        from megatron_2bw.optim.optimizer import torch_reference_optimizer
        from megatron_2bw.testing.reference import build_sequential
        from megatron_2bw.models.families import model_parts
        specs, self.loss_fn, _ = model_parts(cfg)
        self.model = build_sequential(cfg, specs)
        self.params = [p for _, p in self.model.named_parameters()]
        self.opt = torch_reference_optimizer(cfg.optimizer, list(self.model.named_parameters()))
        self.m, self.clip, self.torch = cfg.num_microbatches, cfg.optimizer.clip_grad, torch

    def train_batch(self, it):
        total = self.torch.zeros(())
        for _ in range(self.m):
            x, y = next(it)
            loss = self.loss_fn(self.model(x), y)
            (loss / self.m).backward()
            total += loss.detach() / self.m
        if self.clip > 0:
            self.torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return total


def build(name: str, spec: dict):
    from megatron_2bw.parallel.grid import ProcessGrid
    from megatron_2bw.training.build import build_engine, mock_batches
    cfg = make_config(spec, DEFAULT_SCHEDULE if name == "plain" else name[len("engine-"):])
    data = mock_batches(cfg, 1, 0)  # the same microbatch stream for every variant
    if name == "plain":
        return Plain(cfg), data
    return build_engine(cfg, ProcessGrid(1, 1, 1, rank=0), "cpu"), data


def timed_rounds(runners: dict, names: list, spec: dict) -> tuple[dict, dict]:
    """`warmup` untimed batches of each runner (name -> (object with train_batch, data)), then
    `repeats` rounds of `batches` timed batches each, interleaved and rotated every round:
    ({name: [seconds per round]}, {name: [loss per batch, warm-up included]})."""
    losses = {n: [] for n in names}
    for n, (r, it) in runners.items():
        losses[n] += [float(r.train_batch(it)) for _ in range(spec["warmup"])]
    times = {n: [] for n in names}
    for rep in range(spec["repeats"]):
        k = rep % len(names)
        for n in names[k:] + names[:k]:
            r, it = runners[n]
            t0 = time.perf_counter()
            out = [r.train_batch(it) for _ in range(spec["batches"])]
            times[n].append(time.perf_counter() - t0)
            losses[n] += [float(x) for x in out]
    return times, losses


def run(rank, world, spec, names, profile, breakdown=False):
    import torch
    C.framework_warmup()
    runners = {n: build(n, spec) for n in names}
    times, losses = timed_rounds(runners, names, spec)
    prof = None
    if profile:
        prof = {n: _profile(runners[n], spec) for n in names}
    rows = None
    if breakdown:
        plain = runners["plain"][0] if "plain" in runners else None
        name = next(n for n in reversed(names) if n != "plain")
        rows = OB.engine_rows(runners[name][0], runners[name][1], plain)
        rows.append(OB.ds_adapter_row(spec, make_config))
        rows = [(f"{r[0]}", r[1], r[2], r[3]) for r in rows]
    del torch
    return {"times": times, "losses": losses, "profile": prof, "breakdown": rows,
            "breakdown_of": None if rows is None else name}


def _profile(runner, spec, top=14):
    """cProfile of `batches` more batches: the top functions by own time."""
    import cProfile
    import io
    import pstats
    r, it = runner
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(spec["batches"]):
        r.train_batch(it)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(top)
    return s.getvalue()


def summarize(spec: dict, res: dict, rtol: float = 1e-4) -> dict:
    samples = spec["micro"] * spec["m"] * spec["batches"]
    out = {}
    ref = res["losses"].get("plain")
    for n, ts in res["times"].items():
        rates = [samples / t for t in ts]
        e = {"samples_per_s": C.median(rates), "samples_per_s_runs": rates,
             "ms_per_batch": 1e3 * C.median(ts) / spec["batches"]}
        if ref and n != "plain":
            kind = schedule_kind(n[len("engine-"):])  # batches on the plain loop's weights:
            k = next((t for t in range(3) if kind.weight_of_batch(t) != t), 3)
            diffs = [abs(a - b) / max(abs(b), 1e-12)
                     for a, b in zip(res["losses"][n][:k], ref[:k])]
            e["check"] = (f"{k} batch{'es' if k > 1 else ''} match (max rel diff "
                          f"{max(diffs):.1e})" if max(diffs) <= rtol else
                          f"BROKEN: losses {res['losses'][n][:k]} != {ref[:k]}")
        out[n] = e
    if "plain" in out:
        p = out["plain"]["samples_per_s"]
        for n, e in out.items():
            if n != "plain":
                e["overhead"] = p / e["samples_per_s"] - 1
                # paired per round: the same round's plain run is the closest comparison
                e["overhead_paired_median"] = C.median(
                    [a / b - 1 for a, b in zip(out["plain"]["samples_per_s_runs"],
                                               e["samples_per_s_runs"])])
                e["extra_ms_per_batch"] = e["ms_per_batch"] - out["plain"]["ms_per_batch"]
    return out


def format_summary(spec: dict, out: dict, res: dict) -> str:
    rows = []
    for n, e in out.items():
        rows.append([n, f"{e['samples_per_s']:.2f}", f"{e['ms_per_batch']:.1f}",
                     "-" if n == "plain" else f"{100 * e['overhead']:+.1f}%",
                     "-" if n == "plain" else f"{100 * e['overhead_paired_median']:+.1f}%",
                     "-" if n == "plain" else f"{e['extra_ms_per_batch']:+.1f}",
                     e.get("check", "reference")])
    text = [f"GPT layers={spec['layers']} hidden={spec['hidden']} heads={spec['heads']} "
            f"seq={spec['seq']} vocab={spec['vocab']} micro-batch={spec['micro']} m={spec['m']} "
            f"d=1, 1 thread; {spec['repeats']} interleaved rounds of {spec['batches']} batches",
            C.table(["run", "samples/s", "ms/batch", "overhead", "paired overhead",
                     "extra ms/batch", "loss check"], rows),
            "overhead = plain samples/s / engine samples/s - 1 (medians); paired: median of the "
            "per-round ratios"]
    for n in ("engine-flush", "engine-2bw"):
        if n in out and "overhead" in out[n]:
            v = out[n]["overhead"]
            text.append(f"target: {n} overhead <= 5%: {100 * v:+.1f}% -> "
                        f"{'met' if v <= 0.05 else 'MISSED'}")
    default = f"engine-{DEFAULT_SCHEDULE}"  # the 2BW engine
    if "overhead_paired_median" in out.get(default, {}):
        v = out[default]["overhead_paired_median"]
        text.append(f"target: {default} paired overhead <= 8% (a small model): "
                    f"{100 * v:+.1f}% -> {'met' if v <= 0.08 else 'MISSED'}")
    if res.get("breakdown"):
        text.append(f"\nwhere the engine's fixed costs go ({res['breakdown_of']}, median "
                    "microseconds; 'per batch' counts what a d=1 batch pays; p2p rows: d=2):")
        text.append(OB.format_rows(res["breakdown"]))
    if res.get("profile"):
        for n, p in res["profile"].items():
            text.append(f"\n--- cProfile, {n}, {spec['batches']} batches ---\n{p}")
    return "\n".join(text)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--num-microbatches", "-m", type=int, default=8)
    p.add_argument("--warmup-batches", type=int, default=2)
    p.add_argument("--batches", type=int, default=4, help="timed batches per round")
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--profile", action="store_true", help="cProfile each variant afterwards")
    p.add_argument("--breakdown", action="store_true",
                   help="measure the engine's fixed costs one by one afterwards")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", default=None)
    p.add_argument("--tiny", action="store_true", help="a seconds-long smoke run (tests)")
    args = p.parse_args(argv)
    args.names = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in args.names if v not in VARIANTS]
    if bad:
        p.error(f"unknown variant(s) {', '.join(bad)}: use {', '.join(VARIANTS)}")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    spec = dict(layers=args.num_layers, hidden=args.hidden_size, heads=args.num_attention_heads,
                seq=args.seq_length, vocab=args.vocab_size, micro=args.micro_batch_size,
                m=args.num_microbatches, warmup=args.warmup_batches, batches=args.batches,
                repeats=args.repeats)
    if args.tiny:
        spec.update(layers=2, hidden=16, heads=2, seq=8, vocab=64, micro=2, m=2, warmup=1,
                    batches=2, repeats=2)
    print(f"# bench/overhead.py  {C.stamp()}\n# {C.command_line()}", flush=True)
    res = C.run_spawned(run, 1, (spec, args.names, args.profile, args.breakdown),
                        timeout=args.timeout)[0]
    if args.breakdown:
        res["breakdown"] += OB.p2p_rows(spec)
    out = summarize(spec, res)
    print(format_summary(spec, out, res), flush=True)
    if args.json:
        C.write_json(args.json, {"date": C.stamp(), "command": C.command_line(), "spec": spec,
                                 "results": out, "profile": res.get("profile"),
                                 "breakdown": res.get("breakdown")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
