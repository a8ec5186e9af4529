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
    it, else --lr-warmup-samples, else --lr-warmup-iters x B.

    Megatron-DeepSpeed's token spans (--lr-warmup-tokens, --lr-decay-tokens; tokens = samples x
    seq length S) replace the warmup / decay they name, with its arithmetic: its scheduler steps
    inside batch k and reads the tokens consumed before it (k x B x S without a ramp, the plan's
    consumed samples x S with one); a decay in tokens without a warmup in tokens starts where the
    warmup's last batch began."""

    def __init__(self, cfg: OptimizerConfig, train_iters: int, global_batch: int = 1,
                 seq_length: int | None = None, plan=None):
        self.cfg = cfg
        self.samples = plan.consumed if plan is not None and plan.ramps else None
        self.seq_length = seq_length
        if (cfg.lr_warmup_tokens is not None or cfg.lr_decay_tokens is not None) and \
                seq_length is None:
            raise ValueError("LRSchedule: token spans (--lr-warmup-tokens, --lr-decay-tokens) "
                             "need seq_length (LRSchedule.of(config))")
        self.consumed = self.samples or (lambda k: k * global_batch)  # samples before batch k
        if self.samples is not None:  # spans in samples
            self.decay_iters = (cfg.lr_decay_samples if cfg.lr_decay_samples is not None
                                else (cfg.lr_decay_iters or train_iters) * global_batch)
            self.warmup_iters = (cfg.lr_warmup_fraction * self.decay_iters
                                 if cfg.lr_warmup_fraction is not None else
                                 cfg.lr_warmup_samples or cfg.lr_warmup_iters * global_batch)
        else:
            self._spans_in_iterations(cfg, train_iters, global_batch)
        self.decay_start_tokens = None
        if cfg.lr_decay_tokens is not None:
            self.decay_start_tokens = cfg.lr_warmup_tokens if cfg.lr_warmup_tokens is not None \
                else self._tokens(self._warmup_last_batch())

    def _spans_in_iterations(self, cfg: OptimizerConfig, train_iters: int, global_batch: int
                             ) -> None:
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

    def _warmup_last_batch(self) -> int:
        """The 0-based batch whose step ends the warmup (the step reads step <= warmup)."""
        if self.samples is None:
            return max(round(self.warmup_iters) - 1, 0)
        k = 0
        while self.samples(k + 1) < self.warmup_iters:
            k += 1
        return k

    @classmethod
    def of(cls, config) -> "LRSchedule":
        """The schedule of a whole Config (its optimizer, iterations, batch, seq length and its
        batch plan when the batch ramps)."""
        b = config.batch
        ramps = b.rampup_batch_size or b.step_batch_size_schedule
        return cls(config.optimizer, config.train.train_iters, config.global_batch_size,
                   config.model.seq_length, config.batch_plan if ramps else None)

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
        ramp = self._warmup(iteration, step)
        if ramp is not None:
            init = self.cfg.lr_warmup_init
            return init + (max_lr - init) * ramp
        style = self.cfg.lr_decay_style
        if style == "constant":
            return max_lr
        frac = self._decay(iteration, step)
        coeff = 1.0 - frac if style == "linear" else 0.5 * (math.cos(math.pi * frac) + 1.0)
        return min_lr + coeff * (max_lr - min_lr)

    def _tokens(self, iteration: int) -> int:
        """The tokens Megatron-DeepSpeed's scheduler reads at the step of batch `iteration`
        (0-based): those consumed before that batch."""
        return self.consumed(iteration) * self.seq_length

    def _warmup(self, iteration: int, step: float) -> float | None:
        """How far into the warmup the step of batch `iteration` (its step `step`: an iteration
        count, or samples with a ramp) is (0..1], or None past it."""
        tokens = self.cfg.lr_warmup_tokens
        if tokens is not None:
            done = self._tokens(iteration)
            return done / tokens if 0 < tokens and done <= tokens else None
        warmup = self.warmup_iters
        return step / warmup if warmup and step <= warmup else None

    def _decay(self, iteration: int, step: float) -> float:
        """The decay's progress at the step of batch `iteration`, 0..1 (1: --min-lr)."""
        c = self.cfg
        if c.lr_decay_tokens is not None:
            start = self.decay_start_tokens  # the warmup's end (where its last batch began)
            done, span = self._tokens(iteration) - start, c.lr_decay_tokens - start
        else:
            done, span = step - self.warmup_iters, self.decay_iters - self.warmup_iters
        return min(max(done, 0) / span, 1.0) if span > 0 else 1.0


def rate_of(lr, k: int) -> float:
    """Lr class `k` of an optimizer's `lr` argument: a float (every class) or a tuple (one lr
    per class: 0 the rest, 1 the decoupled embedding and output parameters)."""
    return lr[k] if isinstance(lr, tuple) else lr
