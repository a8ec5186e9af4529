"""The per-peer runners of bench/peers.py: one measured run of the layer stack on one rank.

    run_ours        megatron_2bw's PipelineEngine (schedule 2bw, flush or gpipe)
    run_ours_ds     the same engine through its DeepSpeed API (megatron_2bw.initialize,
                    pipe.PipelineModule, engine.train_batch), as a DeepSpeed script runs it
    run_deepspeed   deepspeed.pipe.PipelineModule + DeepSpeed's PipelineEngine (1F1B with a flush)
    run_torch       torch.distributed.pipelining ScheduleGPipe / Schedule1F1B
    run_single      the single-process reference (and the 2BW delayed-update reference losses)
    run_no_comm     each stage's layers alone, no communication, no bubble

Each is started by _common.run_spawned on fresh processes (runner(name) picks it) and returns
{"elapsed", "losses", "memory", ...} for its rank; unavailable_reason(name) says why a peer
cannot run here (None when it can).
"""
from __future__ import annotations

import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402


# ---- one run on one rank ------------------------------------------------------------------------


def _timed_loop(step, spec, barrier):
    """Run warm-up + timed batches; return (elapsed seconds of the timed ones, losses)."""
    losses, t0 = [], None
    for t in range(spec["warmup"] + spec["batches"]):
        if t == spec["warmup"]:
            barrier()
            t0 = time.perf_counter()
        losses.append(step(t))
    barrier()
    elapsed = time.perf_counter() - t0
    return elapsed, losses


def _data(spec, rank, d):
    """This rank's microbatches (only the first and last stage read data); one batch more than
    the run steps through, because a 2BW window already starts the next batch's forwards."""
    n = (spec["warmup"] + spec["batches"] + 1) * spec["m"]
    if rank not in (0, d - 1):
        return [(None, None)] * n
    return C.microbatches(n, spec["micro"], spec["seq"], spec["hidden"], spec["seed"])


def _barrier():
    from megatron_2bw.parallel.comm import Comm
    Comm().barrier()


def _floats(xs):
    return [None if x is None else float(x) for x in xs]


def run_ours(rank, world, spec, schedule):
    from megatron_2bw.config import (BatchConfig, Config, OptimizerConfig, ParallelConfig,
                                     TrainConfig)
    from megatron_2bw.parallel.grid import ProcessGrid
    from megatron_2bw.pipeline.engine import PipelineEngine
    from megatron_2bw.models.stage import LayerSpec
    d, m, b = world, spec["m"], spec["micro"]
    data = _data(spec, rank, d)
    C.framework_warmup()
    probe = C.MemoryProbe()
    schedule, _, compensation = schedule.partition("+")  # 2bw+predict: a 2BW compensation
    schedule, _, buffers = schedule.partition("-g")  # 2bw-g1: --2bw-grad-buffers 1
    cfg = Config(schedule=schedule, compensation=compensation or "none",
                 grad_buffers=(int(buffers) if buffers.isdigit() else buffers) or None,
                 parallel=ParallelConfig(pipeline=d),
                 batch=BatchConfig(micro_batch_size=b, global_batch_size=b * m),
                 optimizer=OptimizerConfig(lr=spec["lr"], weight_decay=0.0, clip_grad=0.0),
                 train=TrainConfig(train_iters=spec["warmup"] + spec["batches"],
                                   seed=spec["seed"]))
    grid = ProcessGrid(1, d, 1, rank=rank).init_groups()
    specs = [LayerSpec(functools.partial(C.build_layer, spec["stack"], i, spec["hidden"],
                                         spec["heads"], spec["seed"]), name=spec["stack"])
             for i in range(spec["layers"])]
    engine = PipelineEngine(cfg, grid, specs, C.loss_fn, C.partition(spec["layers"], d), "cpu")
    it = iter(data)

    comp = engine.stepper.compensation

    def step(t):
        if t == spec["warmup"] and spec.get("breakdown"):
            engine.enable_trace()
            comp.chunks = comp.chunks_in_waits = 0
        return engine.train_batch(it)

    elapsed, losses = _timed_loop(step, spec, _barrier)
    out = {"elapsed": elapsed, "losses": _floats(losses), "memory": probe.result()}
    if engine.trace is not None:
        out["breakdown"] = breakdown(engine.trace, elapsed)
        # the share of the deferred 2BW prediction done while waiting for a peer
        out["in_waits"] = comp.chunks_in_waits / comp.chunks if comp.chunks else None
    return out


def breakdown(trace: list, elapsed: float) -> dict:
    """Seconds per kind of action in an engine trace: F, B, p2p (posting + waiting for the
    neighbour), R/N/S (reductions and the optimizer step), and the rest of the elapsed time
    (Python between actions, the timed loop, the final barrier)."""
    out = {"F": 0.0, "B": 0.0, "p2p": 0.0, "R/N/S": 0.0}
    for label, start, end in trace:
        k = label[0]
        out["F" if k == "F" else "B" if k == "B" else "R/N/S" if k in "RNS" else "p2p"] += \
            end - start
    out["other"] = elapsed - sum(out.values())
    return out


def _ds_config(spec, **extra) -> dict:
    """The DeepSpeed JSON both DeepSpeed runs use: Adam (torch's), no weight decay, no clipping."""
    return {"train_micro_batch_size_per_gpu": spec["micro"],
            "gradient_accumulation_steps": spec["m"],
            "optimizer": {"type": "Adam", "params": {"lr": spec["lr"], "betas": [0.9, 0.999],
                                                    "eps": 1e-8, "weight_decay": 0.0,
                                                    "torch_adam": True}},
            "gradient_clipping": 0.0, "steps_per_print": 10 ** 9,
            "wall_clock_breakdown": False, **extra}


def run_ours_ds(rank, world, spec, schedule):
    """Our engine behind the DeepSpeed API: run_deepspeed's script with `import megatron_2bw as
    deepspeed` and the schedule in the JSON's pipeline section."""
    import megatron_2bw
    return _deepspeed_script(megatron_2bw, rank, world, spec,
                             _ds_config(spec, pipeline={"schedule": schedule}))


def run_deepspeed(rank, world, spec):
    import importlib
    import deepspeed
    import deepspeed.pipe  # noqa: F401
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # no C++ build
    deepspeed.init_distributed(dist_backend="gloo")
    return _deepspeed_script(deepspeed, rank, world, spec, _ds_config(spec))


def _deepspeed_script(ds, rank, world, spec, config):
    """A DeepSpeed pipeline script's loop through `ds` (the deepspeed package, or ours)."""
    data = _data(spec, rank, world)
    C.framework_warmup()
    probe = C.MemoryProbe()
    layer = C.LAYERS[spec["stack"]]
    net = ds.pipe.PipelineModule(
        layers=[ds.pipe.LayerSpec(layer, i, spec["hidden"], spec["heads"], spec["seed"])
                for i in range(spec["layers"])],
        num_stages=world, loss_fn=C.loss_fn, partition_method="uniform")
    engine, _, _, _ = ds.initialize(
        model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
        config=config)
    it = iter(data)
    elapsed, losses = _timed_loop(lambda t: engine.train_batch(data_iter=it), spec, _barrier)
    return {"elapsed": elapsed, "losses": _floats(losses), "memory": probe.result()}


def run_torch(rank, world, spec, schedule):
    import torch
    from torch import nn
    from torch.distributed import pipelining as P
    d, m = world, spec["m"]
    data = _data(spec, rank, d)
    per_batch = [(torch.cat([x for x, _ in data[t * m:(t + 1) * m]]),
                  torch.cat([y for _, y in data[t * m:(t + 1) * m]]))
                 if rank in (0, d - 1) else (None, None)
                 for t in range(spec["warmup"] + spec["batches"])]
    del data
    C.framework_warmup()
    probe = C.MemoryProbe()
    lo, hi = C.partition(spec["layers"], d)[rank:rank + 2]
    module = nn.Sequential(*[C.build_layer(spec["stack"], i, spec["hidden"], spec["heads"],
                                           spec["seed"]) for i in range(lo, hi)])
    stage = P.PipelineStage(module, rank, d, torch.device("cpu"))
    cls = {"gpipe": P.ScheduleGPipe, "1f1b": P.Schedule1F1B}[schedule]
    sched = cls(stage, n_microbatches=m, loss_fn=C.loss_fn, scale_grads=True)
    opt = torch.optim.Adam(module.parameters(), lr=spec["lr"])

    def step(t):
        x, y = per_batch[t]
        losses = []
        if rank == 0 and d > 1:
            sched.step(x, return_outputs=False)
        elif rank == d - 1:
            args = (x,) if d == 1 else ()
            sched.step(*args, target=y, losses=losses, return_outputs=False)
        else:
            sched.step(return_outputs=False)
        opt.step()
        opt.zero_grad()
        return torch.stack(losses).mean() if losses else None

    elapsed, losses = _timed_loop(step, spec, _barrier)
    return {"elapsed": elapsed, "losses": _floats(losses), "memory": probe.result()}


def run_single(rank, world, spec):
    """The reference: one process, the whole stack, gradient accumulation over m microbatches.
    Also computes, untimed, the losses the 2BW semantics give for batches 0..2."""
    import copy

    import torch
    from torch import nn
    m = spec["m"]
    data = C.microbatches((spec["warmup"] + spec["batches"]) * m, spec["micro"], spec["seq"],
                          spec["hidden"], spec["seed"])
    C.framework_warmup()
    probe = C.MemoryProbe()
    model = nn.Sequential(*[C.build_layer(spec["stack"], i, spec["hidden"], spec["heads"],
                                          spec["seed"]) for i in range(spec["layers"])])
    check_model = copy.deepcopy(model)

    def batch_loss(net, t, grad=True):
        total = torch.zeros(())
        for x, y in data[t * m:(t + 1) * m]:
            if grad:
                loss = C.loss_fn(net(x), y)
                (loss / m).backward()
            else:
                with torch.no_grad():
                    loss = C.loss_fn(net(x), y)
            total += loss.detach() / m
        return total

    # 2BW reference: batch t runs on W(max(t-1, 0)); W(1) = step(W(0), g_0(W(0))) as usual
    opt = torch.optim.Adam(check_model.parameters(), lr=spec["lr"])
    twobw = [batch_loss(check_model, 0), batch_loss(check_model, 1, grad=False)]
    opt.step()
    twobw.append(batch_loss(check_model, 2, grad=False))
    del check_model, opt

    opt = torch.optim.Adam(model.parameters(), lr=spec["lr"])

    def step(t):
        loss = batch_loss(model, t)
        opt.step()
        opt.zero_grad()
        return loss

    elapsed, losses = _timed_loop(step, spec, lambda: None)
    return {"elapsed": elapsed, "losses": _floats(losses), "losses_2bw": _floats(twobw),
            "memory": probe.result()}


def run_no_comm(rank, world, spec):
    """Stage `rank` alone: forward + backward of its layers per microbatch, Adam step per batch,
    no p2p (inputs/gradients from other stages replaced by random tensors of the same shape)."""
    import torch
    from torch import nn
    d, m, b = world, spec["m"], spec["micro"]
    shape = (b, spec["seq"], spec["hidden"])
    data = _data(spec, 0, 1)
    g = torch.Generator().manual_seed(rank)
    stand_in = [torch.randn(*shape, generator=g) for _ in range(2)]
    C.framework_warmup()
    probe = C.MemoryProbe()
    lo, hi = C.partition(spec["layers"], d)[rank:rank + 2]
    module = nn.Sequential(*[C.build_layer(spec["stack"], i, spec["hidden"], spec["heads"],
                                           spec["seed"]) for i in range(lo, hi)])
    opt = torch.optim.Adam(module.parameters(), lr=spec["lr"])

    def step(t):
        total = torch.zeros(())
        for x, y in data[t * m:(t + 1) * m]:
            if rank > 0:
                x = stand_in[0].clone().requires_grad_()
            out = module(x)
            if rank == d - 1:
                loss = C.loss_fn(out, y)
                (loss / m).backward()
                total += loss.detach() / m
            else:
                out.backward(stand_in[1])
        opt.step()
        opt.zero_grad()
        return total if d == 1 else None

    elapsed, losses = _timed_loop(step, spec, _barrier)
    return {"elapsed": elapsed, "losses": _floats(losses), "memory": probe.result()}


def runner(name: str):
    if name.startswith("ours-") and name.endswith("-ds"):
        return functools.partial(run_ours_ds, schedule=name[5:-3])
    if name.startswith("ours-"):
        return functools.partial(run_ours, schedule=name[5:])
    if name.startswith("torch-"):
        return functools.partial(run_torch, schedule=name[6:])
    if name == "deepspeed-1f1b":
        return run_deepspeed
    if name == "no-comm":
        return run_no_comm
    return run_single


def unavailable_reason(name: str) -> str | None:
    import importlib.util
    if name == "deepspeed-1f1b" and importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed (pip install deepspeed)"
    if name.startswith("torch-"):
        try:
            from torch.distributed import pipelining as P
            cls = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}[name[6:]]
            getattr(P, cls)
        except (ImportError, AttributeError) as e:
            return f"torch.distributed.pipelining not usable in this torch: {e}"
    return None
