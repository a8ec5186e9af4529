"""Where the engine's fixed costs go: `python bench/overhead.py --breakdown`.

Each row is one kind of per-action cost of the engine, measured on the overhead bench's model in
its d=1 process (median of many timed calls, interleaved with the plain equivalent where there is
one), then multiplied by how often a batch pays it:

    seeding              _seed_microbatch per forward (skipped on a stage without dropout)
    dispatch             the interpreter's loop per action (handlers replaced by no-ops)
    microbatch work      engine F+B minus the same module's forward, loss and backward: the
                         engine's own Python (data, autograd set-up, loss slot, scaling)
    receive buffer       a pooled receive buffer (acquire + release) vs allocating one
    batch step           R + N + S (reductions, norm, optimizer: the kernel the engine chose)
    optimizer kernel     the flat AdamW step alone: the chosen kernel vs the unfused one
    plain step           the plain loop's clip_grad_norm_ + torch.optim.AdamW.step
    DeepSpeed adapter    DeepSpeedPipelineEngine.train_batch minus its engine's train_batch
    p2p message          one activation through parallel/p2p.P2P, d=2 (two processes)
    handshake            the shape handshake, once per segment (two processes)
"""
from __future__ import annotations

import statistics
import time

import _common as C

REPEATS = 200


def _us(fn, n: int = REPEATS) -> float:
    """Median microseconds of fn() over n calls (after one warm-up call)."""
    fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(ts)


def _paired_us(a, b, n: int) -> float:
    """Median over n alternating rounds of (time of a() - time of b()), microseconds."""
    a(), b()
    diffs = []
    for _ in range(n):
        t0 = time.perf_counter()
        a()
        t1 = time.perf_counter()
        b()
        t2 = time.perf_counter()
        diffs.append((t1 - t0) - (t2 - t1))
    return 1e6 * statistics.median(diffs)


def engine_rows(engine, data, plain=None, cfg=None) -> list:
    """[(component, per, us per occurrence, occurrences per batch)] on a d=1 engine (after
    its timed batches: this trains further on the same data)."""
    import torch
    from megatron_2bw.optim.optimizer import make_optimizer
    from megatron_2bw.schedule import actions as A
    m, rows = engine.m, []
    seed_us = _us(lambda: engine._seed_microbatch(7))
    rows.append(("seeding" + ("" if engine._seeded else " (skipped: no dropout)"), "forward",
                 seed_us, m if engine._seeded else 0))
    window = engine.schedule.window(engine.stage, engine.iteration)
    noop = dict.fromkeys(A.ALL_KINDS, lambda a: None)
    rows.append(("interpreter dispatch", "action",
                 _us(lambda: engine._run(window, noop), 50) / len(window), len(window)))
    rows.append(("engine microbatch work", "microbatch", _microbatch_work(engine, data), m))
    rows.append(_buffer_row(engine))
    t, kind, st = engine.iteration, engine.kind, engine.stepper

    def batch_step():
        slot = kind.slot_of_batch(t)
        st.reduce(t, slot)
        st.norm(t, slot)
        st.step(t, slot, kind.newest_slot(t), kind.step_writes_slot(t))
    rows.append((f"batch step R+N+S ({st.optimizer.impl} kernel)", "batch", _us(batch_step, 20),
                 1))
    w = engine.weights
    src, grad = w.slots[0], torch.randn(w.numel)
    for impl in dict.fromkeys([st.optimizer.impl, "unfused"]):
        opt = make_optimizer(engine.cfg.optimizer, w.numel, w.decay_end, "cpu", impl=impl)
        dst = src.clone()
        rows.append((f"optimizer kernel: {impl}", "batch",
                     _us(lambda: opt.step(src, grad, dst, 1e-4), 20), 1))
    if plain is not None:
        rows.append(("plain loop step (clip_grad_norm_, AdamW)", "batch", _plain_step_us(plain),
                     1))
    return rows


def _microbatch_work(engine, data) -> float:
    """Engine F+B of one microbatch minus the same module's forward + loss + backward."""
    from megatron_2bw.schedule import actions as A
    slot = engine.kind.slot_of_batch(engine.iteration)
    module, scale = engine.weights.modules[slot], 1.0 / engine.m
    k = [10 ** 6]

    def ours():
        k[0] += 1
        engine._forward(A.F(k[0], slot))
        engine._backward(A.B(k[0], slot))

    def plain():
        x, y = next(data)
        (engine.loss_fn(module(x), y) * scale).backward()

    engine._data = data
    try:
        return _paired_us(ours, plain, 100)
    finally:
        engine._data = None


def _buffer_row(engine):
    import torch
    p2p = engine.p2p
    saved = p2p.recv_meta
    p2p.recv_meta = [(torch.Size([engine.cfg.batch.micro_batch_size, engine.cfg.model.seq_length,
                                  engine.cfg.model.hidden_size]), torch.float32, True)]
    try:
        pooled = _us(lambda: p2p.release(p2p.activation_buffers()), 1000)
        fresh = _us(lambda: torch.empty(p2p.recv_meta[0][0]), 1000)
    finally:
        p2p.recv_meta = saved
    return (f"receive buffer, pooled (allocating one: {fresh:.1f} us)", "received tensor",
            pooled, 0)


def _plain_step_us(plain) -> float:
    """clip_grad_norm_ + AdamW.step of the plain loop (its zero_grad(set_to_none) is free)."""
    import torch
    for p in plain.params:
        p.grad = torch.zeros_like(p)

    def step():
        if plain.clip > 0:
            torch.nn.utils.clip_grad_norm_(plain.params, plain.clip)
        plain.opt.step()
    return _us(step, 20)


def ds_adapter_row(spec: dict, build_config, batches: int = 6) -> tuple:
    """(component, per, us, 1): DeepSpeedPipelineEngine.train_batch minus its engine's own
    train_batch, same model (the overhead bench's GPT layers as a PipelineModule), interleaved."""
    import megatron_2bw as ds
    from megatron_2bw.models.gpt import gpt_layer_specs, gpt_loss
    from megatron_2bw.schedule.kinds import DEFAULT_SCHEDULE
    from megatron_2bw.training.build import mock_batches
    cfg = build_config(spec, DEFAULT_SCHEDULE)
    layers = [s.build() for s in gpt_layer_specs(cfg.model)]
    net = ds.pipe.PipelineModule(layers=layers, num_stages=1, loss_fn=gpt_loss,
                                 partition_method="uniform")
    engine, _, _, _ = ds.initialize(model=net, config={
        "train_micro_batch_size_per_gpu": spec["micro"], "gradient_accumulation_steps": spec["m"],
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "steps_per_print": 10 ** 9,
        "pipeline": {"schedule": DEFAULT_SCHEDULE}})
    data = mock_batches(cfg, 1, 0)
    inner = engine._engine  # the core engine the adapter drives (bench-only access)
    per_batch = _paired_us(lambda: engine.train_batch(data), lambda: inner.train_batch(data),
                           batches)
    return ("DeepSpeed adapter (train_batch)", "batch", per_batch, 1)


def p2p_rows(spec: dict) -> list:
    """[(component, per, us, occurrences per batch)] measured on two fresh processes."""
    res = C.run_spawned(_p2p_worker, 2, (spec,), timeout=300)[0]
    shape = f"[{spec['micro']}, {spec['seq']}, {spec['hidden']}] fp32"
    return [(f"p2p message {shape}, one way", "message", res["one_way_us"], 0),
            ("shape handshake (once per segment)", "segment", res["handshake_us"], 0)]


def _p2p_worker(rank, world, spec):
    import torch
    from megatron_2bw.parallel.grid import ProcessGrid
    from megatron_2bw.parallel.p2p import P2P
    from megatron_2bw.parallel.comm import Comm
    grid = ProcessGrid(1, 2, 1, rank=rank).init_groups()
    p2p = P2P(grid, "cpu")
    x = torch.randn(spec["micro"], spec["seq"], spec["hidden"])
    Comm().barrier()
    t0 = time.perf_counter()
    if rank == 0:
        p2p.ensure_meta_sent((x,))
    else:
        p2p.ensure_meta_received()
    handshake = time.perf_counter() - t0
    n, times = 200, []
    for i in range(n):  # ping-pong: activation forward, gradient back
        t0 = time.perf_counter()
        if rank == 0:
            p2p.send([(x, 1)])
            bufs = p2p.gradient_buffers((x,))
            p2p.post_recv(("rg", i), bufs, 1)
            p2p.wait_recv(("rg", i))
        else:
            bufs = p2p.activation_buffers()
            p2p.post_recv(("ra", i), bufs, 0)
            p2p.wait_recv(("ra", i))
            p2p.send([(bufs[0], 0)])
        p2p.wait_sends()
        p2p.release(bufs)
        times.append(time.perf_counter() - t0)
    p2p.drain()
    return {"one_way_us": 1e6 * statistics.median(times) / 2, "handshake_us": 1e6 * handshake}


def format_rows(rows: list) -> str:
    out = []
    for name, per, us, count in rows:
        out.append([name, per, f"{us:.1f}", str(count) if count else "-",
                    f"{us * count / 1e3:.3f}" if count else "-"])
    return C.table(["component", "per", "us each", "per batch (d=1)", "ms per batch"], out)
