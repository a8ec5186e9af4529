"""The single-process references of docs/ARCHITECTURE.md section 1, written with plain PyTorch
only (torch.optim, clip_grad_norm_, gradient accumulation) so that they check the engine's own
optimizer, clipping and reductions instead of reusing them.

gpipe / flush:  W(t+1) = step(W(t), g_t(W(t)))
2bw:            W(t+1) = step(W(t), g_t(V(t))),  V(t) = W(max(t-1, 0))
g_t is the mean gradient over the batch's m * w microbatches; which W(k) batch t runs on is the
schedule kind's `weight_of_batch(t)` (schedule/kinds.py). With a batch-size ramp m is batch t's
(`Config.batch_plan`), the lr Megatron's in samples (optim/lr.py); evaluation runs the final m.

2BW's staleness compensation (`--2bw-compensation`, pipeline/compensation.py), with k = t - 1:
    predict  V(t) = P(t) for t >= 2: W(k) moved by the update torch.optim's state after k steps
             implies at lr(k), the lr of the step W(k) -> W(t) being predicted. AdamW:
             W(k) * (1 - lr * wd) - lr * m_hat / (sqrt(v_hat) + eps) with the bias corrections of
             k steps; SGD: W(k) - lr * momentum_buffer. V(0) = V(1) = W(0) (no state yet). The
             gradient g_t(P(t)) steps the real W(t); P(t) never enters the trajectory otherwise.
    predict-spike  after torch.optim.AdamW's step t, every parameter also moves by
             -lr * (1 - b1) / (1 - b1^(t+1)) * (grad - m) / (sqrt(v_hat) + eps) (m, v after
             the step: the spike; the momentum term weighs b1 * m and the late gradient gets
             its missed share (1 - b1) at once); V(t) is `predict`'s, made from the spiked W.
    predict-nesterov  V(t) as `predict`'s with m replaced by b1 * m + (1 - b1) * g, g the latest
             gradient (each parameter's .grad as AdamW's step k used it, clipped; it is still
             there when V(t) is made, before batch t's gradient reaches the model).
The predictions and the spike are computed here from torch.optim's state, not by the engine's code.

--decoupled-lr: the embedding and output parameters (`is_embedding_or_output_parameter`, the tied
word embedding once) are torch.optim param groups of their own (Megatron's is_decoupled_lr
groups) whose lr each step is the schedule between --decoupled-lr and --decoupled-min-lr (else
--min-lr); every other group steps at the lr. The predictions and the spike use each group's lr.
"""
from __future__ import annotations

import copy
import math

import torch

from megatron_2bw.config import Config
from megatron_2bw.models.stage import LayerSpec, StageModule
from megatron_2bw.optim.lr import LRSchedule
from megatron_2bw.optim.optimizer import torch_reference_optimizer
from megatron_2bw.schedule.compensation_methods import compensation_method
from megatron_2bw.schedule.kinds import schedule_kind


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
    plan, eval_m = cfg.batch_plan, cfg.num_microbatches
    model = build_sequential(cfg, specs)
    params = list(model.named_parameters())
    optimizer = torch_reference_optimizer(cfg.optimizer, params)
    lr_at = LRSchedule.of(cfg)
    kind = schedule_kind(cfg.schedule)
    method = compensation_method(cfg.compensation)
    delayed = kind.delay > 0
    grad_model = copy.deepcopy(model) if delayed else model  # holds V(t)
    versions = {}  # k -> what a batch with weight_of_batch k runs on (W(k), or its prediction)
    if start and method.predicts:
        raise ValueError("reference_train: `start` with --2bw-compensation is not modelled (the "
                         "resumed version would be a prediction); start from the initialization")
    t0 = _resume(model, grad_model, optimizer, start, versions, kind) if start else 0
    streams = [make_batches(r) for r in range(w)]
    eval_streams = [make_eval_batches(r) for r in range(w)] if eval_interval else []
    losses, eval_losses = [], []
    for t in range(t0, t0 + num_iters):
        grad_model.zero_grad(set_to_none=True)
        total, m = 0.0, plan.m(t)
        for stream in streams:
            for _ in range(m):
                inputs, labels = next(stream)
                args = inputs if isinstance(inputs, tuple) else (inputs,)
                loss = loss_fn(grad_model(*args), labels)
                (loss / (m * w)).backward()
                total += loss.item() / (m * w)
        losses.append(total)
        if delayed:
            versions[t] = (_predicted(model, optimizer, _rates(lr_at, t), method.nesterov)
                           if method.predicts  # from W(t), before step t
                           else copy.deepcopy(model.state_dict()))
            for (_, p), (_, q) in zip(params, grad_model.named_parameters()):
                p.grad = q.grad
        if cfg.optimizer.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_([p for _, p in params], cfg.optimizer.clip_grad)
        for group in optimizer.param_groups:
            group["lr"] = _group_lr(group, _rates(lr_at, t))
        optimizer.step()
        if method.spikes:
            _spike(optimizer, _rates(lr_at, t))
        if delayed:
            k = kind.weight_of_batch(t + 1)
            grad_model.load_state_dict(versions[k])
            versions = {j: v for j, v in versions.items() if j >= k}
        if eval_interval and (t + 1) % eval_interval == 0:
            eval_losses.append(_evaluate(model, loss_fn, eval_streams, eval_m))
    return {name: p.detach().clone() for name, p in params}, losses, eval_losses


def _rates(lr_at: LRSchedule, t: int) -> tuple[float, float]:
    """(lr, decoupled lr) of step t, the second by Megatron's rule written out here: the same
    warmup and decay between --decoupled-lr and --decoupled-min-lr (else --min-lr)."""
    c = lr_at.cfg
    if c.decoupled_lr is None:
        return lr_at(t), lr_at(t)
    low = c.min_lr if c.decoupled_min_lr is None else c.decoupled_min_lr
    return lr_at(t), lr_at.at(t, c.decoupled_lr, low)


def _group_lr(group: dict, rates: tuple[float, float]) -> float:
    return rates[1] if group.get("decoupled") else rates[0]


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


def _predicted(model, optimizer, rates, nesterov: bool = False) -> dict:
    """model's state dict with every parameter moved by the update torch.optim's state implies
    at `rates` (lr, decoupled lr; a float: both; see the module docstring; `nesterov`: with each
    parameter's .grad, the latest gradient, in the momentum term); unchanged before the first
    step."""
    moved = {}
    rates = rates if isinstance(rates, tuple) else (rates, rates)
    with torch.no_grad():
        for group in optimizer.param_groups:
            lr = _group_lr(group, rates)
            for p in group["params"]:
                st = optimizer.state.get(p)
                if not st:
                    continue
                if "exp_avg" in st:
                    b1, b2 = group["betas"]
                    k = float(st["step"])
                    denom = st["exp_avg_sq"].sqrt() / math.sqrt(1 - b2 ** k) + group["eps"]
                    m = b1 * st["exp_avg"] + (1 - b1) * p.grad if nesterov else st["exp_avg"]
                    moved[id(p)] = (p * (1 - lr * group["weight_decay"])
                                    - lr / (1 - b1 ** k) * m / denom)
                else:
                    moved[id(p)] = p - lr * st["momentum_buffer"]
    return {name: moved.get(id(v), v).detach().clone()
            for name, v in model.state_dict(keep_vars=True).items()}


def _spike(optimizer, rates) -> None:
    """After AdamW's step: each parameter moves by -lr (1 - b1) / bias1 (grad - m) / denom, lr
    its group's of `rates` (lr, decoupled lr; a float: both)."""
    rates = rates if isinstance(rates, tuple) else (rates, rates)
    with torch.no_grad():
        for group in optimizer.param_groups:
            b1, b2 = group["betas"]
            lr = _group_lr(group, rates)
            for p in group["params"]:
                st = optimizer.state[p]
                k = float(st["step"])
                denom = st["exp_avg_sq"].sqrt() / math.sqrt(1 - b2 ** k) + group["eps"]
                p.add_(-lr * (1 - b1) / (1 - b1 ** k) * (p.grad - st["exp_avg"]) / denom)


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
