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

    Megatron-DeepSpeed's token spans (--lr-warmup-tokens, --lr-decay-tokens; tokens = samples x
    seq length S) replace the warmup / decay they name, with its arithmetic: its scheduler steps
    inside batch k and reads the tokens consumed before it, (k - 1) x B x S; a decay in tokens
    without a warmup in tokens starts where the iteration warmup's last batch began."""

    def __init__(self, cfg: OptimizerConfig, train_iters: int, global_batch: int = 1,
                 seq_length: int | None = None):
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
        self.tokens_per_iteration = None
        if cfg.lr_warmup_tokens is not None or cfg.lr_decay_tokens is not None:
            if seq_length is None:
                raise ValueError("LRSchedule: token spans (--lr-warmup-tokens, "
                                 "--lr-decay-tokens) need seq_length (LRSchedule.of(config))")
            self.tokens_per_iteration = global_batch * seq_length

    @classmethod
    def of(cls, config) -> "LRSchedule":
        """The schedule of a whole Config (its optimizer, iterations, batch and seq length)."""
        return cls(config.optimizer, config.train.train_iters, config.global_batch_size,
                   config.model.seq_length)

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
        step = iteration + 1
        ramp = self._warmup(step)
        if ramp is not None:
            init = self.cfg.lr_warmup_init
            return init + (max_lr - init) * ramp
        style = self.cfg.lr_decay_style
        if style == "constant":
            return max_lr
        frac = self._decay(step)
        coeff = 1.0 - frac if style == "linear" else 0.5 * (math.cos(math.pi * frac) + 1.0)
        return min_lr + coeff * (max_lr - min_lr)

    def _tokens(self, step: int) -> int:
        """The tokens Megatron-DeepSpeed's scheduler reads at its step-th step: those consumed
        before that batch."""
        return (step - 1) * self.tokens_per_iteration

    def _warmup(self, step: int) -> float | None:
        """How far into the warmup step `step` is (0..1], or None past it."""
        tokens = self.cfg.lr_warmup_tokens
        if tokens is not None:
            return self._tokens(step) / tokens if 0 < tokens and self._tokens(step) <= tokens \
                else None
        warmup = self.warmup_iters
        return step / warmup if warmup and step <= warmup else None

    def _decay(self, step: int) -> float:
        """The decay's progress at step `step`, 0..1 (1: --min-lr)."""
        c = self.cfg
        if c.lr_decay_tokens is not None:
            start = c.lr_warmup_tokens if c.lr_warmup_tokens is not None else \
                self._tokens(round(self.warmup_iters))  # where the warmup's last batch began
            done, span = self._tokens(step) - start, c.lr_decay_tokens - start
        else:
            done, span = step - self.warmup_iters, self.decay_iters - self.warmup_iters
        return min(max(done, 0) / span, 1.0) if span > 0 else 1.0


def rate_of(lr, k: int) -> float:
    """Lr class `k` of an optimizer's `lr` argument: a float (every class) or a tuple (one lr
    per class: 0 the rest, 1 the decoupled embedding and output parameters)."""
    return lr[k] if isinstance(lr, tuple) else lr
