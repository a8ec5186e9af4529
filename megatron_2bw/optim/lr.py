"""Learning-rate schedule as a pure function of the iteration (Megatron's warmup + decay).

The engine takes any callable iteration -> lr (`PipelineEngine(lr_schedule=...)`); this is the
default, built from the config. DeepSpeed's schedulers live with the DeepSpeed front door
(`ds_config.DeepSpeedLR`)."""
from __future__ import annotations

import math

from megatron_2bw.config import OptimizerConfig


class LRSchedule:
    def __init__(self, cfg: OptimizerConfig, train_iters: int):
        self.cfg = cfg
        self.decay_iters = cfg.lr_decay_iters or train_iters

    def __call__(self, iteration: int) -> float:
        """lr used by the optimizer step of batch `iteration` (0-based)."""
        c = self.cfg
        step = iteration + 1
        if c.lr_warmup_iters and step <= c.lr_warmup_iters:
            return c.lr * step / c.lr_warmup_iters
        if c.lr_decay_style == "constant":
            return c.lr
        span = max(self.decay_iters - c.lr_warmup_iters, 1)
        frac = min(max(step - c.lr_warmup_iters, 0) / span, 1.0)
        if c.lr_decay_style == "linear":
            coeff = 1.0 - frac
        else:
            coeff = 0.5 * (math.cos(math.pi * frac) + 1.0)
        return c.min_lr + coeff * (c.lr - c.min_lr)
