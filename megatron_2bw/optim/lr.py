"""Learning-rate schedule as a pure function of the iteration (Megatron's warmup + decay).

The engine takes any callable iteration -> lr (`PipelineEngine(lr_schedule=...)`); this is the
default, built from the config. DeepSpeed's schedulers live with the DeepSpeed front door
(`ds_config.DeepSpeedLR`)."""
from __future__ import annotations

import math

from megatron_2bw.config import OptimizerConfig


class LRSchedule:
    """Megatron's warmup and decay in iterations. Megatron counts them in samples; with one global
    batch B its spans are, in iterations: --lr-decay-samples / B (else --lr-decay-iters, else
    --train-iters), warmup --lr-warmup-fraction x the decay span, else --lr-warmup-samples / B,
    else --lr-warmup-iters (fractions of an iteration kept: the same lr at every step)."""

    def __init__(self, cfg: OptimizerConfig, train_iters: int, global_batch: int = 1):
        self.cfg = cfg
        if cfg.lr_decay_samples is not None:
            self.decay_iters = cfg.lr_decay_samples / global_batch
        else:
            self.decay_iters = cfg.lr_decay_iters or train_iters
        if cfg.lr_warmup_fraction is not None:
            self.warmup_iters = cfg.lr_warmup_fraction * self.decay_iters
        elif cfg.lr_warmup_samples:
            self.warmup_iters = cfg.lr_warmup_samples / global_batch
        else:
            self.warmup_iters = cfg.lr_warmup_iters

    def __call__(self, iteration: int) -> float:
        """lr used by the optimizer step of batch `iteration` (0-based)."""
        c = self.cfg
        step = iteration + 1
        warmup = self.warmup_iters
        if warmup and step <= warmup:
            return c.lr * step / warmup
        if c.lr_decay_style == "constant":
            return c.lr
        span = self.decay_iters - warmup
        frac = min(max(step - warmup, 0) / span, 1.0) if span > 0 else 1.0
        if c.lr_decay_style == "linear":
            coeff = 1.0 - frac
        else:
            coeff = 0.5 * (math.cos(math.pi * frac) + 1.0)
        return c.min_lr + coeff * (c.lr - c.min_lr)
