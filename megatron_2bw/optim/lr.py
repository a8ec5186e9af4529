"""Learning-rate schedule as a pure function of the iteration (Megatron's warmup + decay).

The engine takes any callable iteration -> lr (`PipelineEngine(lr_schedule=...)`); this is the
default, built from the config. DeepSpeed's schedulers live with the DeepSpeed front door
(`ds_config.DeepSpeedLR`).

Decoupled lr (Megatron's --decoupled-lr / --decoupled-min-lr): the input embedding and the output
layer (the parameters a model marks `is_embedding_or_output_parameter`, both copies of a tied
word embedding) follow the same warmup and decay between their own maximum (--decoupled-lr) and
minimum (--decoupled-min-lr, else --min-lr), as Megatron's param group with max_lr/min_lr does.
`rates(iteration)` is what the optimizer steps with: the lr, or the pair (lr, decoupled lr), the
optimizer's two lr classes (optim/optimizer.py). Like the rest of the schedule it is a function
of the iteration and the config (which checkpoints save): a resumed run continues it."""
from __future__ import annotations

import math

from megatron_2bw.config import OptimizerConfig


class LRSchedule:
    """Megatron's warmup and decay in iterations. Megatron counts them in samples; with one global
    batch B its spans are, in iterations: --lr-decay-samples / B (else --lr-decay-iters, else
    --train-iters), warmup --lr-warmup-fraction x the decay span, else --lr-warmup-samples / B,
    else --lr-warmup-iters (fractions of an iteration kept: the same lr at every step).

    With a batch-size ramp (`plan`, a config.ramps.BatchPlan whose batch changes) the schedule is
    Megatron's in samples, as its OptimizerParamScheduler steps by each batch's samples: the step
    of batch t takes the lr at plan.consumed(t + 1) samples (what the one-batch form above is at
    (t + 1) x B), over the spans --lr-decay-samples (else --lr-decay-iters or --train-iters x B,
    B the final global batch, as Megatron's iteration-based spans are), warmup the fraction of
    it, else --lr-warmup-samples, else --lr-warmup-iters x B."""

    def __init__(self, cfg: OptimizerConfig, train_iters: int, global_batch: int = 1,
                 plan=None):
        self.cfg = cfg
        self.samples = plan.consumed if plan is not None and plan.ramps else None
        if self.samples is not None:  # spans in samples
            self.decay_iters = (cfg.lr_decay_samples if cfg.lr_decay_samples is not None
                                else (cfg.lr_decay_iters or train_iters) * global_batch)
            self.warmup_iters = (cfg.lr_warmup_fraction * self.decay_iters
                                 if cfg.lr_warmup_fraction is not None else
                                 cfg.lr_warmup_samples or cfg.lr_warmup_iters * global_batch)
            return
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
        return self.at(iteration, self.cfg.lr, self.cfg.min_lr)

    def decoupled(self, iteration: int) -> float:
        """The decoupled lr of that step (--decoupled-lr; the lr without it)."""
        c = self.cfg
        if c.decoupled_lr is None:
            return self(iteration)
        low = c.decoupled_min_lr if c.decoupled_min_lr is not None else c.min_lr
        return self.at(iteration, c.decoupled_lr, low)

    def rates(self, iteration: int) -> float | tuple[float, float]:
        """What the optimizer steps with at that step: the lr, or (lr, decoupled lr) with
        --decoupled-lr (optim/optimizer.py's lr classes 0 and 1)."""
        if self.cfg.decoupled_lr is None:
            return self(iteration)
        return self(iteration), self.decoupled(iteration)

    def at(self, iteration: int, max_lr: float, min_lr: float) -> float:
        """The schedule's value at `iteration` between `max_lr` and `min_lr` (warmup from
        --lr-warmup-init, default 0, for every lr class, as Megatron's scheduler)."""
        step = iteration + 1 if self.samples is None else self.samples(iteration + 1)
        warmup = self.warmup_iters
        if warmup and step <= warmup:
            init = self.cfg.lr_warmup_init
            return init + (max_lr - init) * step / warmup
        style = self.cfg.lr_decay_style
        if style == "constant":
            return max_lr
        span = self.decay_iters - warmup
        frac = min(max(step - warmup, 0) / span, 1.0) if span > 0 else 1.0
        coeff = 1.0 - frac if style == "linear" else 0.5 * (math.cos(math.pi * frac) + 1.0)
        return min_lr + coeff * (max_lr - min_lr)


def lr_schedule_of(cfg) -> LRSchedule:
    """The Megatron lr schedule of a Config (its batch plan when the batch ramps)."""
    return LRSchedule(cfg.optimizer, cfg.train.train_iters, cfg.global_batch_size,
                      cfg.batch_plan)


def rate_of(lr, k: int) -> float:
    """Lr class `k` of an optimizer's `lr` argument: a float (every class) or a tuple (one lr
    per class: 0 the rest, 1 the decoupled embedding and output parameters)."""
    return lr[k] if isinstance(lr, tuple) else lr
