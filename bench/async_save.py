#!/usr/bin/env python
"""Training time hidden by --async-save.

    python bench/async_save.py                  # GPT 2x128, vocab 2048: a save ~ 6 iterations
    python bench/async_save.py --dir /scratch   # checkpoints on another file system

One spawned process (one compute thread) trains the same GPT three ways in the same run, saving
every --save-interval iterations through the training loop's Checkpointer (checkpoint/saver.py):

    none    no checkpoints: the iteration time
    sync    --ckpt-format torch_dist, synchronous: training waits for every save
    async   --async-save: the state is copied to host memory and a background thread writes
            it while training goes on; published once written (the save_busy control flag)

Rounds are interleaved (none, sync, async, then rotated). A round times --iters iterations with
a save at every --save-interval-th one before the last; the round ends by waiting for the save in
flight, so whatever async does not hide is counted. Prints the medians: one save's time against
one iteration's (the bench is meant for a save longer than an iteration), the time the saves add
to training, and the share of the synchronous save time that async hides:
1 - (async - none) / (sync - none). The write speed is the file system's under --dir (default:
a temporary directory).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

VARIANTS = ("none", "sync", "async")


def make_config(spec: dict, variant: str, save_dir: str):
    from megatron_2bw.config import (BatchConfig, Config, ModelConfig, OptimizerConfig,
                                     ParallelConfig, TrainConfig)
    model = ModelConfig(num_layers=spec["layers"], hidden_size=spec["hidden"],
                        num_attention_heads=spec["heads"], seq_length=spec["seq"],
                        vocab_size=spec["vocab"])
    b = spec["micro"]
    train = TrainConfig(train_iters=10 ** 6, save=None if variant == "none" else save_dir,
                        save_interval=0 if variant == "none" else spec["interval"],
                        ckpt_format="torch_dist", async_save=variant == "async")
    return Config(model=model, parallel=ParallelConfig(pipeline=1),
                  batch=BatchConfig(micro_batch_size=b, global_batch_size=b * spec["m"]),
                  optimizer=OptimizerConfig(lr=1e-4), train=train).validate(1)


def one_round(variant: str, spec: dict, root: str) -> dict:
    from megatron_2bw.checkpoint.saver import Checkpointer
    from megatron_2bw.parallel.grid import ProcessGrid
    from megatron_2bw.training.build import build_engine, mock_batches
    save_dir = tempfile.mkdtemp(prefix=f"{variant}-", dir=root)
    cfg = make_config(spec, variant, save_dir)
    grid = ProcessGrid.from_config(cfg, 0, 1).init_groups()
    engine = build_engine(cfg, grid, "cpu")
    data = mock_batches(cfg, 1, 0)
    for _ in range(spec["warmup"]):
        engine.train_batch(data)
    saver = None if variant == "none" else Checkpointer(cfg, grid, engine)
    stalls = []
    start, cpu = time.perf_counter(), time.process_time()
    for it in range(1, spec["iters"] + 1):
        engine.train_batch(data)
        if saver is None:
            continue
        saver.poll()
        if it % spec["interval"] == 0 and it < spec["iters"]:
            t0 = time.perf_counter()
            saver.save()
            stalls.append(time.perf_counter() - t0)
    if saver is not None:
        saver.wait()
    total, cpu = time.perf_counter() - start, time.process_time() - cpu
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(save_dir)
               for f in fs)
    shutil.rmtree(save_dir, ignore_errors=True)
    return {"total_s": total, "cpu_s": cpu, "stalls_s": stalls,
            "bytes": size // max(len(stalls), 1)}


def run(rank, world, spec, root):
    C.framework_warmup()
    rounds = {v: [] for v in VARIANTS}
    for rep in range(spec["repeats"]):
        k = rep % len(VARIANTS)
        for v in VARIANTS[k:] + VARIANTS[:k]:
            rounds[v].append(one_round(v, spec, root))
    return rounds


def summarize(spec: dict, rounds: dict) -> dict:
    med = {v: C.median([r["total_s"] for r in rounds[v]]) for v in VARIANTS}
    cpu = {v: C.median([r["cpu_s"] for r in rounds[v]]) for v in VARIANTS}
    saves = len(rounds["sync"][0]["stalls_s"])
    iteration = med["none"] / spec["iters"]
    save = C.median([s for r in rounds["sync"] for s in r["stalls_s"]])
    stall = C.median([s for r in rounds["async"] for s in r["stalls_s"]])
    added = {v: med[v] - med["none"] for v in ("sync", "async")}
    return {"median_s": med, "cpu_s": cpu, "saves_per_round": saves, "iteration_s": iteration,
            "save_s": save, "async_stall_s": stall, "save_over_iteration": save / iteration,
            "added_s": added, "checkpoint_bytes": rounds["sync"][0]["bytes"],
            "hidden": 1 - added["async"] / added["sync"] if added["sync"] > 0 else None}


def format_summary(spec: dict, out: dict) -> str:
    med, add = out["median_s"], out["added_s"]
    cpu = out["cpu_s"]
    rows = [["none", f"{med['none']:.2f}", f"{cpu['none']:.2f}", "-", "-"],
            ["sync", f"{med['sync']:.2f}", f"{cpu['sync']:.2f}", f"{add['sync']:+.2f}",
             f"{1e3 * out['save_s']:.0f}"],
            ["async", f"{med['async']:.2f}", f"{cpu['async']:.2f}", f"{add['async']:+.2f}",
             f"{1e3 * out['async_stall_s']:.0f}"]]
    hidden = out["hidden"]
    return "\n".join([
        f"GPT layers={spec['layers']} hidden={spec['hidden']} heads={spec['heads']} "
        f"seq={spec['seq']} vocab={spec['vocab']} micro-batch={spec['micro']} m={spec['m']}, "
        f"d=1, 1 thread; {spec['repeats']} interleaved rounds of {spec['iters']} iterations, "
        f"{out['saves_per_round']} saves each (every {spec['interval']}), checkpoint "
        f"{C.mb(out['checkpoint_bytes'])} MB",
        C.table(["run", "s per round", "CPU s per round", "added by saves (s)",
                 "training waits per save (ms)"], rows),
        f"one iteration {1e3 * out['iteration_s']:.0f} ms, one synchronous save "
        f"{1e3 * out['save_s']:.0f} ms: a save takes {out['save_over_iteration']:.1f} "
        "iterations",
        "async hides " + ("-" if hidden is None else f"{100 * hidden:.0f}%") +
        " of the synchronous save time (1 - added async / added sync)",
        f"machine: {out['cpus']} CPUs, load average {out['load']:.1f} at the start: the "
        "background write hides only what a core that training leaves idle can do (on a busy "
        "machine it slows training instead)"])


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--num-microbatches", "-m", type=int, default=2)
    p.add_argument("--iters", type=int, default=24, help="timed iterations per round")
    p.add_argument("--save-interval", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations per round")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", default=None)
    p.add_argument("--tiny", action="store_true", help="a seconds-long smoke run (tests)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    spec = dict(layers=args.num_layers, hidden=args.hidden_size, heads=args.num_attention_heads,
                seq=args.seq_length, vocab=args.vocab_size, micro=args.micro_batch_size,
                m=args.num_microbatches, iters=args.iters, interval=args.save_interval,
                warmup=args.warmup, repeats=args.repeats)
    if args.tiny:
        spec.update(layers=2, hidden=16, heads=2, seq=8, vocab=64, micro=1, m=1, iters=4,
                    interval=2, warmup=1, repeats=1)
    print(f"# bench/async_save.py  {C.stamp()}\n# {C.command_line()}", flush=True)
    root = tempfile.mkdtemp(prefix="async_save_", dir=args.dir)
    load = os.getloadavg()[0]
    try:
        rounds = C.run_spawned(run, 1, (spec, root), timeout=args.timeout)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    out = summarize(spec, rounds)
    out.update(cpus=os.cpu_count(), load=load)
    print(format_summary(spec, out), flush=True)
    if args.json:
        C.write_json(args.json, {"date": C.stamp(), "command": C.command_line(), "spec": spec,
                                 "results": out, "rounds": rounds})
    return 0


if __name__ == "__main__":
    sys.exit(main())
