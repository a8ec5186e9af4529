"""Megatron-DeepSpeed's token-based lr (--lr-warmup-tokens, --lr-decay-tokens) against its
arithmetic, written out below from deepspeedai/Megatron-DeepSpeed's
megatron/optimizer_param_scheduler.py (get_lr, step) and megatron/training.py (train_step steps
the scheduler by the global batch with the tokens consumed so far; the loop adds the batch's
tokens, samples x seq length, after it): every iteration's lr, as its log line shows it, for
token warmup and decay, the mixed forms (a warmup in iterations or samples and a decay in
tokens; a warmup in tokens and a decay in iterations), cosine, linear and constant; and the
settings its scheduler cannot follow, refused in one line. (A run's log lines:
tests/e2e/test_mds_tokens_run.py.)"""
import json
import math

import pytest

from megatron_2bw.config import ConfigError
from megatron_2bw.config.build import build_config
from megatron_2bw.optim.lr import LRSchedule
from megatron_2bw.pretrain import build_parser

B, S = 4, 16   # global batch, seq length: 64 tokens an iteration


class MegatronDeepSpeedScheduler:
    """Its OptimizerParamScheduler's lr, steps in samples (no weight-decay schedule)."""

    def __init__(self, max_lr, min_lr, warmup_steps, decay_steps, style, warmup_tokens,
                 decay_tokens):
        self.max_lr, self.min_lr, self.style = max_lr, min_lr, style
        self.warmup_steps, self.decay_steps = warmup_steps, decay_steps
        self.warmup_tokens, self.decay_tokens = warmup_tokens, decay_tokens
        self.num_steps = self.num_tokens = 0
        self.step(0, 0)

    def get_lr(self):
        if self.warmup_tokens is None:
            if self.warmup_steps > 0 and self.num_steps <= self.warmup_steps:
                if self.num_steps == self.warmup_steps and self.decay_tokens is not None:
                    self.warmup_tokens = self.num_tokens  # a step warmup, a token decay
                return self.max_lr * self.num_steps / self.warmup_steps
        elif self.warmup_tokens > 0 and self.num_tokens <= self.warmup_tokens:
            return self.max_lr * self.num_tokens / self.warmup_tokens
        if self.style == "constant":
            return self.max_lr
        if self.decay_tokens is None:
            if self.num_steps > self.decay_steps:
                return self.min_lr
            ratio = (self.num_steps - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        else:
            if self.num_tokens > self.decay_tokens:
                return self.min_lr
            ratio = ((self.num_tokens - self.warmup_tokens)
                     / (self.decay_tokens - self.warmup_tokens))
        assert 0.0 <= ratio <= 1.0
        coeff = 1.0 - ratio if self.style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def step(self, increment, token_num):
        self.num_tokens = token_num
        self.num_steps += increment
        self.lr = self.get_lr()


def logged_lrs(sched, iters) -> list[float]:
    """The lr of each iteration's log line: the scheduler after that iteration's step."""
    tokens, out = 0, []
    for _ in range(iters):
        sched.step(B, tokens)            # train_step: the optimizer, then the scheduler
        out.append(sched.lr)
        tokens += B * S                  # the loop: consumed_train_tokens += samples x seq
    return out


def built(argv):
    args = build_parser("gpt").parse_args(["--mock-data", "--global-batch-size", str(B),
                                           "--seq-length", str(S), "--lr", "0.1",
                                           "--min-lr", "0.01"] + argv)
    return build_config(args, "gpt", 1).config


CASES = [  # flags, Megatron-DeepSpeed's (warmup steps, decay steps, warmup tokens, decay tokens)
    (["--train-iters", "30", "--lr-warmup-tokens", "300", "--lr-decay-tokens", "1500"],
     (0, 30 * B, 300, 1500)),
    (["--train-iters", "30", "--lr-warmup-iters", "3", "--lr-decay-tokens", "1500"],
     (3 * B, 30 * B, None, 1500)),
    (["--train-iters", "30", "--lr-warmup-tokens", "200", "--lr-decay-iters", "25"],
     (0, 25 * B, 200, None)),
    (["--train-samples", "120", "--lr-warmup-samples", "8", "--lr-decay-tokens", "1500"],
     (8, 120, None, 1500)),
    (["--train-iters", "30", "--lr-warmup-tokens", "0", "--lr-decay-tokens", "1000"],
     (0, 30 * B, 0, 1000)),
    (["--train-iters", "30", "--lr-warmup-fraction", "0.1", "--lr-decay-iters", "20",
      "--lr-decay-tokens", "1500"], (0.1 * 20 * B, 20 * B, None, 1500)),
]


@pytest.mark.parametrize("style", ["cosine", "linear", "constant"])
@pytest.mark.parametrize("flags,spans", CASES, ids=[" ".join(c[0][2:]) for c in CASES])
def test_token_spans_give_megatron_deepspeeds_lr_at_every_iteration(flags, spans, style):
    cfg = built(flags + ["--lr-decay-style", style])
    warmup_steps, decay_steps, warmup_tokens, decay_tokens = spans
    want = logged_lrs(MegatronDeepSpeedScheduler(0.1, 0.01, warmup_steps, decay_steps, style,
                                                 warmup_tokens, decay_tokens), 30)
    ours = LRSchedule.of(cfg)
    got = [ours(i) for i in range(cfg.train.train_iters)]
    assert got == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert len(set(got)) > 10 or style == "constant"  # the schedule moves


@pytest.mark.parametrize("argv,message", [
    (["--train-iters", "10", "--lr-decay-tokens", "500"],
     "--lr-decay-tokens counts from the warmup's end in tokens: give --lr-warmup-tokens (0 for "
     "no warmup), or a warmup of whole iterations (--lr-warmup-iters N, or --lr-warmup-samples "
     "a multiple of the global batch 4)"),
    (["--train-samples", "40", "--lr-warmup-samples", "6", "--lr-decay-tokens", "500"],
     "--lr-decay-tokens counts from the warmup's end in tokens"),
])
def test_a_token_decay_its_scheduler_cannot_start_is_one_line(argv, message):
    """Megatron-DeepSpeed fails there (None - tokens): refused before anything starts."""
    with pytest.raises(ConfigError) as e:
        built(argv)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_token_spans_with_a_deepspeed_scheduler_are_one_line(tmp_path):
    (tmp_path / "ds.json").write_text(json.dumps({
        "train_batch_size": B, "scheduler": {"type": "WarmupLR", "params": {
            "warmup_min_lr": 0, "warmup_max_lr": 0.1, "warmup_num_steps": 3}}}))
    with pytest.raises(ConfigError, match="--lr-warmup-tokens follows Megatron's lr schedule "
                                          ".*not the DeepSpeed config's \"scheduler\""):
        built(["--lr-warmup-tokens", "100", "--deepspeed_config", str(tmp_path / "ds.json")])
