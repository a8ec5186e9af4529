"""Measuring a profile on this device: each layer type's forward and backward as a 1F1B pipeline
runs them, the step's local work, the batch iterator, and a --2bw-compensation's work beyond the
step (`measure_profile`, what `tools/plan.py --profile-out` runs; profile.py holds what it
returns, `MeasuredProfile`, and says how the planner reads it).
"""
from __future__ import annotations

import statistics
import time

from megatron_2bw.planner.profile import KINDS, SHAPE_FIELDS, MeasuredProfile
from megatron_2bw.schedule.compensation_methods import NONE as NO_COMPENSATION
from megatron_2bw.schedule.compensation_methods import compensation_method


def _median_time(fn, repeats: int) -> float:
    times = []
    for i in range(repeats + 2):  # two warm-up runs
        t0 = time.perf_counter()
        fn()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _interleaved_times(make_inputs, forward, repeats: int, sync, read=None) -> tuple:
    """Median (forward, backward, read) seconds, timed as 1F1B runs them: the forward of
    microbatch i, then the backward of microbatch i - 1, alternately (two warm-up rounds).
    `read()`, when given, is timed right before each forward, where the engine reads a
    microbatch (after a backward: caches as cold as in the engine)."""
    import torch
    fwds, bwds, reads, prev = [], [], [], None
    for i in range(repeats + 3):
        args = make_inputs()
        t0 = time.perf_counter()
        if read is not None:
            read()
        t1 = time.perf_counter()
        out = forward(args)
        sync()
        t2 = time.perf_counter()
        grad = torch.randn_like(out) if out.dim() else None
        if prev is not None:
            t3 = time.perf_counter()
            prev[0].backward(prev[1])
            sync()
            if i >= 3:
                bwds.append(time.perf_counter() - t3)
        if i >= 2:
            fwds.append(t2 - t1)
            reads.append(t1 - t0)
        prev = (out, grad)
    return statistics.median(fwds), statistics.median(bwds), statistics.median(reads)


def _batch_reader(model, micro_batch: int):
    """next() of the project's batch iterator over the family's synthetic dataset (sample lookup,
    stacking, the input/label split): what the engine does to read one microbatch."""
    from megatron_2bw.config import BatchConfig, Config, TrainConfig
    from megatron_2bw.training.build import mock_batches
    cfg = Config(model=model, batch=BatchConfig(micro_batch, micro_batch),
                 train=TrainConfig(train_iters=1))
    it = mock_batches(cfg, 1, 0)
    return lambda: next(it)


CHAIN = 3  # transformer layers timed back to back (distinct weights: realistic cache misses)


def _layer_runners(model, dev, dt):
    """(modules, inputs(kind, b), forward(kind, inputs) -> output or loss) for the model family.
    The transformer entry is a chain of CHAIN layers; its times are divided by CHAIN."""
    import torch

    s, h, V = model.seq_length, model.hidden_size, model.vocab_size
    torch.manual_seed(0)
    bert = getattr(model, "family", "gpt") == "bert"
    if bert:
        from megatron_2bw.models.bert import BertEmbedding, BertHeads, BertLayer, make_bert_loss
        emb, head, loss_fn = BertEmbedding(model), BertHeads(model), make_bert_loss()
        chain = [BertLayer(model, causal=False) for _ in range(CHAIN)]
    else:
        from megatron_2bw.models.gpt import GPTEmbedding, GPTHead, gpt_loss
        from megatron_2bw.models.transformer import TransformerLayer
        emb, head, loss_fn = GPTEmbedding(model), GPTHead(model), gpt_loss
        chain = [TransformerLayer(model) for _ in range(CHAIN)]
    mods = {"embedding": emb, "transformer": torch.nn.ModuleList(chain), "head": head}
    for mod in mods.values():
        mod.to(dev, dt).train()

    def inputs(kind, b):
        tokens = torch.randint(0, V, (b, s), device=dev)
        mask = torch.ones(b, s, dtype=torch.bool, device=dev)
        x = torch.randn(b, s, h, device=dev, dtype=dt, requires_grad=True)
        return tokens, mask, x

    def forward(kind, args):
        tokens, mask, x = args
        if kind == "embedding":
            return emb(tokens, torch.zeros_like(tokens), mask)[0] if bert else emb(tokens)
        if kind == "transformer":
            for layer in chain:
                x = layer(x, mask)[0] if bert else layer(x)
            return x
        if bert:
            labels = (tokens, torch.ones_like(tokens),
                      torch.zeros(tokens.shape[0], dtype=torch.long, device=dev))
            return loss_fn(head(x, mask), labels)
        return loss_fn(head(x), tokens)
    return mods, inputs, forward


def measure_profile(model, micro_batches=(1, 2, 4), dtype: str = "fp32", device: str = "cpu",
                    repeats: int = 5, threads: int | None = 1,
                    compensation: str = NO_COMPENSATION) -> MeasuredProfile:
    """Time each layer type of the model (GPT or BERT) forward and backward on this device;
    `compensation` (a --2bw-compensation): also its work beyond the step, as the engine's
    optimizer does it (in the step's pass where the kernel fuses it, else after it)."""
    import torch

    from megatron_2bw.config import OptimizerConfig
    from megatron_2bw.optim.optimizer import FlatAdamW
    from megatron_2bw.pipeline.batch_step import squared_norm
    from megatron_2bw.pipeline.host_memory import keep_freed_memory
    from megatron_2bw.pipeline.weights import DTYPES

    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    dev, dt = torch.device(device), DTYPES[dtype]
    if dev.type == "cpu":
        keep_freed_memory()  # as the engine does: time layers with the allocator it will have
    sync = (lambda: torch.cuda.synchronize()) if dev.type == "cuda" else (lambda: None)
    try:
        mods, inputs, forward = _layer_runners(model, dev, dt)
        layers = {k: {} for k in KINDS}
        data_per_sample = 0.0
        for b in micro_batches:
            for kind in KINDS:
                div = CHAIN if kind == "transformer" else 1
                read = _batch_reader(model, b) if kind == "transformer" else None
                fwd, bwd, rd = _interleaved_times(lambda: inputs(kind, b),
                                                  lambda a: forward(kind, a), repeats, sync, read)
                layers[kind][int(b)] = (fwd / div, bwd / div)
                if read is not None and b == max(micro_batches):
                    data_per_sample = rd / b
        n = max(sum(p.numel() for p in mods["transformer"].parameters()), 1 << 20)
        opt = FlatAdamW(n, n // 2, dev, OptimizerConfig())
        src, dst = torch.randn(n, device=dev), torch.empty(n, device=dev)
        grad = torch.randn(n + 1, device=dev)

        def step():  # what R, N and S do locally: scale, squared norm, Adam into the other slot
            grad.mul_(1.0)
            torch.stack([squared_norm(grad[:n]), grad[n]])
            opt.step(src, grad[:n], dst, 1e-3)
            grad.zero_()
            sync()
        per_param = _median_time(step, repeats) / n
        extra = {}
        if compensation != NO_COMPENSATION:
            extra[compensation] = _compensation_time(compensation, n, dev, dt, src, dst, grad,
                                                     repeats, sync, per_param)
    finally:
        torch.set_num_threads(old_threads)
    shape = {k: getattr(model, k, None) for k in SHAPE_FIELDS}
    name = f"{dev.type}, {threads} thread{'s' if threads != 1 else ''}" if dev.type == "cpu" \
        else torch.cuda.get_device_name(dev)
    return MeasuredProfile(shape, layers, per_param, dtype, name, data_per_sample, extra)


def _compensation_time(name, n, dev, dt, src, dst, grad, repeats, sync, plain) -> float:
    """Seconds per parameter the compensation adds to the step (>= 0)."""
    import torch

    from megatron_2bw.config import OptimizerConfig
    from megatron_2bw.optim.optimizer import FlatAdamW
    from megatron_2bw.pipeline.batch_step import squared_norm
    method = compensation_method(name)
    opt = FlatAdamW(n, n // 2, dev, OptimizerConfig(), keep_grad=method.keeps_grad)
    slot = torch.empty(n, device=dev, dtype=dt)  # what batch t + 2 runs on

    def step():
        grad.mul_(1.0)
        torch.stack([squared_norm(grad[:n]), grad[n]])
        if opt.fuses_prediction(slot.dtype):
            opt.step(src, grad[:n], dst, 1e-3, predict=(slot, 1e-3, method.nesterov,
                                                        method.spikes))
        else:
            opt.step(src, grad[:n], dst, 1e-3)
            opt.predict(dst, slot, 1e-3, method.nesterov,
                        (grad[:n], 1e-3) if method.spikes else None)
        grad.zero_()
        sync()
    return max(_median_time(step, repeats) / n - plain, 0.0)


__all__ = ["measure_profile", "CHAIN"]
