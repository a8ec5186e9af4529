#!/usr/bin/env python
"""Planner accuracy on this machine: simulator-predicted vs engine-measured time per batch, d=2.

    python bench/plan_accuracy.py [--schedules 2bw,flush,gpipe] [--hidden-size 128] ...
    python bench/plan_accuracy.py --repeats 5 --compensation predict   # 2BW compensated too

On 2 gloo processes (one pipeline stage each, one thread each), for every schedule:
1. both processes measure the layer profile (`planner.measure_profile`, what
   `tools/plan.py --profile-out` does) at the same time, so the profile sees the same two busy
   cores the engine will, and time p2p ping-pongs of one activation and of 16 activations (the
   link's latency and bandwidth, fitted to those two sizes); both again after the engine ran
   (load drifts), and the planner uses the means;
2. they run the engine (warm-up batches, then timed batches: the median batch, slowest rank);
3. the planner predicts the layout from those means with the same uniform partition the engine
   uses (`gpt_partition`);
4. steps 1-3 are repeated in `--repeats` interleaved rounds (schedule order rotated each round);
   the script prints the medians of predicted, measured and predicted/measured, and the range of
   the ratio over rounds.

`--compensation NAME` runs 2BW with that --2bw-compensation too (a row `2bw+NAME`): the profile
also times the method's work beyond the step (`measure_profile(compensation=)`), the planner
counts it in each stage's S, and the row prints that cost per batch.

Another busy process on the cores makes both numbers noisy: run it on an idle machine.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_2bw.config import BatchConfig, Config, ModelConfig, ParallelConfig, TrainConfig
from megatron_2bw.models.gpt import gpt_partition  # noqa: E402
from megatron_2bw.planner import Topology, predict, stage_plan  # noqa: E402
from megatron_2bw.planner.cost_model import LayerTimes, Layout, Setup  # noqa: E402
from megatron_2bw.planner.measure import measure_profile  # noqa: E402
from megatron_2bw.planner.profile import MeasuredProfile  # noqa: E402
from megatron_2bw.schedule.compensation_methods import NONE, method_names  # noqa: E402
from megatron_2bw.schedule.kinds import schedule_kind, schedule_names  # noqa: E402


BIG = 16  # the second message size, in activations (the tied embedding gradient is ~this big)


def _link(rank, shape, comm) -> tuple:
    """(one-way seconds for one activation, for BIG activations) between ranks 0 and 1."""
    small = _p2p(rank, shape, comm)
    big = _p2p(rank, (BIG,) + tuple(shape), comm)
    return small, big


def _fit(small: float, big: float, nbytes: float) -> tuple:
    """(latency s, bandwidth bytes/s) of a line through (nbytes, small) and (BIG*nbytes, big)."""
    per_byte = (big - small) / ((BIG - 1) * nbytes)
    if per_byte <= 0:  # noise: no measurable bandwidth term
        return small, float("inf")
    return max(small - per_byte * nbytes, 0.0), 1.0 / per_byte


def _p2p(rank, shape, comm, trips=23):
    import torch
    x = torch.randn(*shape, device=comm.device)
    times = []
    for _ in range(trips):
        t0 = time.perf_counter()
        if rank == 0:
            comm.send(x, 1)
            comm.recv(x, 1)
        else:
            comm.recv(x, 0)
            comm.send(x, 0)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[3:]) / 2


def _worker(rank, world_size, cfgs, warmup, iters, repeats, out):
    from megatron_2bw.parallel.grid import ProcessGrid
    from megatron_2bw.training.build import build_engine, mock_batches
    results = []
    for rnd in range(repeats):
        for k in range(len(cfgs)):  # interleaved rounds, the order rotated each round
            i = (k + rnd) % len(cfgs)
            cfg = cfgs[i]
            m, b = cfg.model, cfg.batch.micro_batch_size
            shape = (b, m.seq_length, m.hidden_size)
            grid = ProcessGrid.from_config(cfg, rank, world_size).init_groups()
            p2p = _link(rank, shape, grid.comm)
            before = measure_profile(m, (b,), repeats=5,
                                     compensation=cfg.compensation).to_dict()
            engine = build_engine(cfg, grid, "cpu")
            data = mock_batches(cfg, grid.data, grid.dp_rank)
            engine.start(warmup + iters)
            for _ in range(warmup):
                engine.train_batch(data)
            grid.comm.barrier()
            ends = [time.perf_counter()]
            for _ in range(iters):
                engine.train_batch(data)
                ends.append(time.perf_counter())
            grid.comm.barrier()
            # median batch: robust to another process stealing the core for a moment
            per_batch = statistics.median(b - a for a, b in zip(ends, ends[1:]))
            after = measure_profile(m, (b,), repeats=5,
                                    compensation=cfg.compensation).to_dict()
            p2p = [(x + y) / 2 for x, y in zip(p2p, _link(rank, shape, grid.comm))]
            results.append({"schedule": i, "round": rnd, "per_batch": per_batch, "p2p": p2p,
                            "profiles": [before, after]})
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(results, f)


def _mean_profile(dicts) -> MeasuredProfile:
    first = dicts[0]
    layers = {kind: {int(b): tuple(statistics.mean(d["layers"][kind][b][k] for d in dicts)
                                   for k in ("forward_s", "backward_s"))
                     for b in table} for kind, table in first["layers"].items()}
    step = statistics.mean(d["step_s_per_param"] for d in dicts)
    data = statistics.mean(d["data_s_per_sample"] for d in dicts)
    comp = {k: statistics.mean(d["compensation_s_per_param"][k] for d in dicts)
            for k in first.get("compensation_s_per_param", {})}
    return MeasuredProfile(first["model"], layers, step, first["dtype"], first["device"], data,
                           comp)


def predict_round(schedule, res, model, micro_batch, global_batch, compensation=NONE) -> tuple:
    """(predicted, measured seconds per batch, link latency s, link Gbit/s, the compensation's
    step cost per batch on the slower stage, s) from both ranks' results of one round of one
    schedule."""
    measured = max(r["per_batch"] for r in res)
    small, big = (statistics.mean(r["p2p"][i] for r in res) for i in (0, 1))
    nbytes = 4.0 * micro_batch * model.seq_length * model.hidden_size
    latency, bandwidth = _fit(small, big, nbytes)
    profile = _mean_profile([p for r in res for p in r["profiles"]])
    # the link as measured (what the p2p and the tied-gradient all-reduce cost)
    gbps = min(bandwidth * 8 / 1e9, 1e9)
    topo = Topology(num_nodes=1, gpus_per_node=2, gpu_memory_gb=1e3,
                    intra_node_latency_us=latency * 1e6, intra_node_bandwidth_gbps=gbps)
    setup = Setup(model, "fp32", "adam", compensation=compensation)
    layout = Layout(schedule, 1, 2, 1, micro_batch, global_batch // micro_batch)
    plan = stage_plan(setup, layout, LayerTimes(setup, profile, topo), topo,
                      bounds=gpt_partition(model, 2))
    comp = 0.0
    if compensation != NONE:  # what the planner adds to S for it: the plan without, compared
        plain = Setup(model, "fp32", "adam")
        base = stage_plan(plain, layout, LayerTimes(plain, profile, topo), topo,
                          bounds=gpt_partition(model, 2))
        comp = max(x - y for x, y in zip(plan.step, base.step))
    return predict(plan, full=True).time_per_batch, measured, latency, gbps, comp


def run(schedules=schedule_names(), layers=4, hidden=128, heads=4, seq=64, vocab=1024,
        micro_batch=4, global_batch=32, warmup=3, iters=10, repeats=3, log=print,
        compensation=NONE):
    """`compensation`: also run 2BW with that --2bw-compensation (row `2bw+NAME`)."""
    from megatron_2bw.training.spawn import spawn
    if compensation not in method_names():
        raise SystemExit(f"--compensation {compensation!r}: use one of {', '.join(method_names())}")
    model = ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                        seq_length=seq, vocab_size=vocab)
    runs = [(s, NONE) for s in schedules]
    if compensation != NONE:
        stale = next(n for n in schedules if schedule_kind(n).delay == 1)  # what it compensates
        runs.append((stale, compensation))
    cfgs = [Config(model=model, parallel=ParallelConfig(pipeline=2, data=1, backend="gloo"),
                   batch=BatchConfig(micro_batch, global_batch),
                   train=TrainConfig(train_iters=warmup + iters), schedule=s,
                   compensation=c).validate(2)
            for s, c in runs]
    with tempfile.TemporaryDirectory() as d:
        spawn(_worker, 2, args=(cfgs, warmup, iters, repeats, d), timeout_minutes=20)
        ranks = [json.load(open(os.path.join(d, f"{r}.json"))) for r in range(2)]
    rows = []
    for i, (sched, comp) in enumerate(runs):
        rounds = []
        for rnd in range(repeats):
            res = [next(x for x in ranks[r] if x["schedule"] == i and x["round"] == rnd)
                   for r in range(2)]
            rounds.append(predict_round(sched, res, model, micro_batch, global_batch, comp))
        ratios = [x[0] / x[1] for x in rounds]
        pred = statistics.median(x[0] for x in rounds)
        measured = statistics.median(x[1] for x in rounds)
        latency = statistics.median(x[2] for x in rounds)
        gbps = statistics.median(x[3] for x in rounds)
        comp_s = statistics.median(x[4] for x in rounds)
        ratio = statistics.median(ratios)
        name = sched if comp == NONE else f"{sched}+{comp}"
        rows.append({"schedule": name, "predicted_s": pred, "measured_s": measured,
                     "ratio": ratio, "ratios": ratios, "link_latency_s": latency,
                     "link_gbps": gbps, "compensation_step_s": comp_s})
        extra = f"  compensation in S {comp_s * 1e3:.2f} ms/batch" if comp != NONE else ""
        log(f"{name:6s} predicted {pred * 1e3:8.2f} ms/batch  measured {measured * 1e3:8.2f} "
            f"ms/batch  predicted/measured {ratio:.3f} (rounds {min(ratios):.3f}-"
            f"{max(ratios):.3f})  link {latency * 1e6:.0f} us + {gbps:.3g} Gbit/s{extra}")
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schedules", default=",".join(schedule_names()))
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3,
                   help="interleaved rounds (profile + engine per schedule); medians are shown")
    p.add_argument("--compensation", default=NONE, choices=method_names(),
                   help="also run 2BW with this --2bw-compensation (row 2bw+NAME)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON too")
    a = p.parse_args(argv)
    rows = run(a.schedules.split(","), a.num_layers, a.hidden_size, a.num_attention_heads,
               a.seq_length, a.vocab_size, a.micro_batch_size, a.global_batch_size, a.warmup,
               a.iters, a.repeats, compensation=a.compensation)
    if a.json:
        print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
