"""Optimizers over one flat fp32 buffer: a handful of kernels per step, no Python per parameter.

`step(src, grad, dst, lr)` computes dst = update(src, grad). dst may be src (one weight version)
or another buffer (2BW writes the new version next to the one still in use). The arithmetic
matches torch.optim.AdamW / torch.optim.SGD so a plain PyTorch loop is an exact reference.
The flat layout puts decayed parameters (matrices, embeddings) first: [0, decay_end).

Two pure functions of the state serve 2BW's staleness compensation (pipeline/compensation.py);
neither changes the optimizer's state, and a fused `step` must keep the state's meaning for them:
- `predict(src, dst, lr)`: dst = the weights the next step would make of src if its gradient were
  the one the state expects (Adam: the bias-corrected moments' update; SGD: the momentum buffer).
- `spike(dst, grad, lr)` (Adam), right after a step with `grad`: adds to dst the part of grad's
  momentum contribution that a one-step-late gradient missed (spike compensation for delay 1).
"""
from __future__ import annotations

import math

import torch

from ..config import OptimizerConfig


class FlatAdamW:
    def __init__(self, numel: int, decay_end: int, device, cfg: OptimizerConfig):
        self.decay_end, self.cfg = decay_end, cfg
        self.exp_avg = torch.zeros(numel, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(numel, dtype=torch.float32, device=device)
        self.steps = 0

    def step(self, src: torch.Tensor, grad: torch.Tensor, dst: torch.Tensor, lr: float) -> None:
        c = self.cfg
        self.steps += 1
        b1, b2 = c.adam_beta1, c.adam_beta2
        self.exp_avg.lerp_(grad, 1 - b1)
        self.exp_avg_sq.mul_(b2).addcmul_(grad, grad, value=1 - b2)
        bias1 = 1 - b1 ** self.steps
        denom = self._denom()
        if dst is not src:
            dst.copy_(src)
        if c.weight_decay and self.decay_end:
            dst[:self.decay_end].mul_(1 - lr * c.weight_decay)
        dst.addcdiv_(self.exp_avg, denom, value=-lr / bias1)

    def _denom(self) -> torch.Tensor:
        """sqrt(v / bias2) + eps of the current state (a new fp32 buffer)."""
        bias2 = 1 - self.cfg.adam_beta2 ** self.steps
        return self.exp_avg_sq.sqrt().div_(math.sqrt(bias2)).add_(self.cfg.adam_eps)

    def predict(self, src: torch.Tensor, dst: torch.Tensor, lr: float) -> None:
        """dst = src after the step the current moments imply at `lr`: src * (1 - lr * wd) on the
        decayed range, minus lr * m_hat / (sqrt(v_hat) + eps), bias corrections of the steps taken
        (a gradient equal to m_hat would leave m_hat and v_hat unchanged). The arithmetic is fp32;
        dst (any float dtype) is written once. No state changes; before any step, dst = src."""
        if self.steps == 0:
            dst.copy_(src)
            return
        c = self.cfg
        out = self._denom()
        torch.div(self.exp_avg, out, out=out).mul_(-lr / (1 - c.adam_beta1 ** self.steps))
        if c.weight_decay and self.decay_end:
            out[:self.decay_end].add_(src[:self.decay_end], alpha=-lr * c.weight_decay)
        dst.copy_(out.add_(src))

    def spike(self, dst: torch.Tensor, grad: torch.Tensor, lr: float) -> None:
        """Right after step(..., grad, dst, lr): move dst from the momentum update
        m_hat(t+1) to the delay-compensated one (b1 * m(t+1) + (1 - b1) * grad) / bias1, i.e.
        add -lr * (1 - b1) * (grad - m(t+1)) / bias1 / (sqrt(v_hat) + eps). No state changes."""
        b1 = self.cfg.adam_beta1
        coef = -lr * (1 - b1) / (1 - b1 ** self.steps)
        dst.addcdiv_(torch.sub(grad, self.exp_avg), self._denom(), value=coef)

    def state_dict(self) -> dict:
        return {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.exp_avg.copy_(state["exp_avg"])
        self.exp_avg_sq.copy_(state["exp_avg_sq"])
        self.steps = int(state["steps"])


class FlatSGD:
    """torch.optim.SGD semantics: coupled weight decay, momentum buffer initialized to the first
    gradient."""

    def __init__(self, numel: int, decay_end: int, device, cfg: OptimizerConfig):
        self.decay_end, self.cfg = decay_end, cfg
        self.momentum = torch.zeros(numel, dtype=torch.float32, device=device)
        self.steps = 0

    def step(self, src: torch.Tensor, grad: torch.Tensor, dst: torch.Tensor, lr: float) -> None:
        c = self.cfg
        if c.weight_decay and self.decay_end:
            grad[:self.decay_end].add_(src[:self.decay_end], alpha=c.weight_decay)
        update = grad
        if c.sgd_momentum:
            if self.steps == 0:
                self.momentum.copy_(grad)
            else:
                self.momentum.mul_(c.sgd_momentum).add_(grad)
            update = self.momentum
        self.steps += 1
        if dst is not src:
            torch.add(src, update, alpha=-lr, out=dst)
        else:
            dst.add_(update, alpha=-lr)

    def predict(self, src: torch.Tensor, dst: torch.Tensor, lr: float) -> None:
        """dst = src - lr * momentum buffer: the next step if the momentum keeps its direction
        (weight decay is inside the buffer, as torch.optim.SGD couples it). Arithmetic in fp32,
        dst written once; no state changes; zero buffer (no step yet): dst = src."""
        dst.copy_(torch.add(src, self.momentum, alpha=-lr))

    def state_dict(self) -> dict:
        return {"momentum": self.momentum, "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.momentum.copy_(state["momentum"])
        self.steps = int(state["steps"])


def make_optimizer(cfg: OptimizerConfig, numel: int, decay_end: int, device):
    cls = {"adam": FlatAdamW, "sgd": FlatSGD}[cfg.name]
    return cls(numel, decay_end, device, cfg)


def torch_reference_optimizer(cfg: OptimizerConfig, named_params):
    """The torch.optim equivalent (used by the single-process reference): matrices decay,
    vectors (biases, norms) do not."""
    params = [p for _, p in named_params]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    if cfg.name == "adam":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                 eps=cfg.adam_eps, foreach=False)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.sgd_momentum, foreach=False)
