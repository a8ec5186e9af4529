"""The single-process references of docs/ARCHITECTURE.md section 1, written with plain PyTorch
only (torch.optim, clip_grad_norm_, gradient accumulation) so that they check the engine's own
optimizer, clipping and reductions instead of reusing them.

gpipe / flush:  W(t+1) = step(W(t), g_t(W(t)))
2bw:            W(t+1) = step(W(t), g_t(W(max(t-1, 0))))
g_t is the mean gradient over the batch's m * w microbatches; which W(k) batch t runs on is the
schedule kind's `weight_of_batch(t)` (pipeline/registry.py).
"""
from __future__ import annotations

import copy

import torch

from .config import Config
from .optim.lr import LRSchedule
from .optim.optimizer import torch_reference_optimizer
from .pipeline.module import LayerSpec, StageModule
from .pipeline.registry import schedule_kind


def build_sequential(cfg: Config, specs: list[LayerSpec]) -> StageModule:
    """The whole model in one module (tied layers share one parameter)."""
    return StageModule(specs, 0, len(specs), seed=cfg.train.seed)


def reference_train(cfg: Config, specs: list[LayerSpec], loss_fn, make_batches,
                    num_iters: int, eval_interval: int = 0, make_eval_batches=None,
                    start: dict | None = None
                    ) -> tuple[dict[str, torch.Tensor], list[float], list[float]]:
    """Returns (final parameters by name, per-iteration losses, evaluation losses).

    make_batches(dp_rank) -> iterator of (inputs, labels) microbatches of that replica, from the
    first batch trained on. Every `eval_interval` iterations the newest weights are evaluated on
    m microbatches per replica of make_eval_batches(dp_rank). `start` resumes instead of starting
    from the initialization: {"iteration": t0, "newest": W(t0) by name, "previous": W(t0-1) by
    name or None, "optimizer": {"steps": n, "exp_avg"/"exp_avg_sq" (Adam) or "momentum" (SGD):
    buffers by name}}; batches t0 .. t0 + num_iters - 1 are trained."""
    w = cfg.data_parallel_size
    m = cfg.num_microbatches
    model = build_sequential(cfg, specs)
    params = list(model.named_parameters())
    optimizer = torch_reference_optimizer(cfg.optimizer, params)
    lr_at = LRSchedule(cfg.optimizer, cfg.train.train_iters)
    kind = schedule_kind(cfg.schedule)
    delayed = kind.delay > 0
    grad_model = copy.deepcopy(model) if delayed else model  # holds W(kind.weight_of_batch(t))
    versions = {}  # k -> W(k), kept while a later batch still runs on it
    t0 = _resume(model, grad_model, optimizer, start, versions, kind) if start else 0
    streams = [make_batches(r) for r in range(w)]
    eval_streams = [make_eval_batches(r) for r in range(w)] if eval_interval else []
    losses, eval_losses = [], []
    for t in range(t0, t0 + num_iters):
        grad_model.zero_grad(set_to_none=True)
        total = 0.0
        for stream in streams:
            for _ in range(m):
                inputs, labels = next(stream)
                args = inputs if isinstance(inputs, tuple) else (inputs,)
                loss = loss_fn(grad_model(*args), labels)
                (loss / (m * w)).backward()
                total += loss.item() / (m * w)
        losses.append(total)
        if delayed:
            versions[t] = copy.deepcopy(model.state_dict())  # W(t)
            for (_, p), (_, q) in zip(params, grad_model.named_parameters()):
                p.grad = q.grad
        if cfg.optimizer.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_([p for _, p in params], cfg.optimizer.clip_grad)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(t)
        optimizer.step()
        if delayed:
            k = kind.weight_of_batch(t + 1)
            grad_model.load_state_dict(versions[k])
            versions = {j: v for j, v in versions.items() if j >= k}
        if eval_interval and (t + 1) % eval_interval == 0:
            eval_losses.append(_evaluate(model, loss_fn, eval_streams, m))
    return {name: p.detach().clone() for name, p in params}, losses, eval_losses


def _resume(model, grad_model, optimizer, start: dict, versions: dict, kind) -> int:
    """Put `start` (reference_train's docstring) into the model, the version the first batch
    runs on and the torch optimizer's state; returns the first batch."""
    t0 = int(start["iteration"])

    def put(weights: dict) -> dict:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(weights[name])
        return copy.deepcopy(model.state_dict())

    if grad_model is not model:
        versions[t0 - 1] = put(start.get("previous") or start["newest"])
    versions[t0] = put(start["newest"])
    if grad_model is not model:
        grad_model.load_state_dict(versions[kind.weight_of_batch(t0)])
    state = start.get("optimizer") or {}
    for name, p in model.named_parameters():
        if "exp_avg" in state:
            optimizer.state[p] = {"step": torch.tensor(float(state["steps"])),
                                  "exp_avg": state["exp_avg"][name].clone(),
                                  "exp_avg_sq": state["exp_avg_sq"][name].clone()}
        elif "momentum" in state and state.get("steps"):
            optimizer.state[p] = {"momentum_buffer": state["momentum"][name].clone()}
    return t0


def _evaluate(model, loss_fn, streams, m: int) -> float:
    model.eval()
    total = 0.0
    with torch.no_grad():
        for stream in streams:
            for _ in range(m):
                inputs, labels = next(stream)
                args = inputs if isinstance(inputs, tuple) else (inputs,)
                total += loss_fn(model(*args), labels).item() / (m * len(streams))
    model.train()
    return total
