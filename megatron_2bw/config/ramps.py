"""Megatron's batch-size ramps: --rampup-batch-size START INCREMENT SAMPLES (the global batch grows
from START by INCREMENT, evenly over SAMPLES samples, up to --global-batch-size) and
--step-batch-size-schedule "T0:B0 T1:B1 ..." (batch Bi from Ti tokens on; K/M/B/T suffixes; T0 is
0; the largest Bi is the global batch).

The engine trains with one global batch. A ramp is taken with Megatron's meaning when the whole run
stays on its first step: every iteration then trains at the first batch size, as Megatron's would,
and the log says so in one line. A run that would reach the ramp's next step is refused in one
line before anything starts (`resolve_ramp`), naming the iteration where the batch would change.
"""
from __future__ import annotations

import argparse

from megatron_2bw.config.choices import ConfigError

SUFFIXES = {"K": 1e3, "M": 1e6, "B": 1e9, "T": 1e12}


def add_ramp_args(g) -> None:
    g.add_argument("--rampup-batch-size", nargs=3, type=int, default=None,
                   metavar=("START", "INCREMENT", "SAMPLES"),
                   help="Megatron's batch-size ramp: taken while the run stays at START (one "
                        "global batch: a run that reaches the ramp's next step is refused)")
    g.add_argument("--step-batch-size-schedule", default=None, metavar='"T0:B0 T1:B1 ..."',
                   help="Megatron's stepped batch size (thresholds in tokens, K/M/B/T "
                        "suffixes): taken while the run stays on the first step")


def _tokens(text: str) -> float:
    text = text.strip()
    scale = SUFFIXES.get(text[-1:].upper(), None)
    return float(text[:-1]) * scale if scale else float(text)


def parse_schedule(text: str) -> list[tuple[float, int]]:
    """[(tokens, batch)] of a --step-batch-size-schedule; ValueError on a bad one."""
    steps = []
    for part in text.replace(",", " ").split():
        threshold, _, batch = part.partition(":")
        steps.append((_tokens(threshold), int(batch)))
    if not steps or steps[0][0] != 0 or any(b < 1 for _, b in steps) \
            or any(x[0] >= y[0] for x, y in zip(steps, steps[1:])):
        raise ValueError(text)
    return steps


def batch_ramp_problems(args: argparse.Namespace) -> list[str]:
    """Format errors of the two ramp flags (one line each), for the parser's one message."""
    out = []
    ramp = getattr(args, "rampup_batch_size", None)
    schedule = getattr(args, "step_batch_size_schedule", None)
    if ramp is not None and schedule is not None:
        out.append("--rampup-batch-size and --step-batch-size-schedule exclude each other: "
                   "give one")
    if ramp is not None:
        start, inc, samples = ramp
        if start < 1 or inc < 1 or samples < 0:
            out.append(f"--rampup-batch-size {start} {inc} {samples}: START and INCREMENT must "
                       "be >= 1, SAMPLES >= 0")
        elif args.global_batch_size is None or (args.global_batch_size - start) % inc \
                or args.global_batch_size < start:
            out.append(f"--rampup-batch-size {start} {inc} {samples} needs --global-batch-size "
                       f"START + k x INCREMENT (got {args.global_batch_size})")
    if schedule is not None:
        try:
            parse_schedule(schedule)
        except ValueError:
            out.append(f'--step-batch-size-schedule "{schedule}": give "0:B0 T1:B1 ..." with '
                       "rising token thresholds (K/M/B/T suffixes) starting at 0")
    return out


def resolve_ramp(args: argparse.Namespace, seq_length: int) -> tuple[int | None, str | None]:
    """(the global batch the whole run trains at, the log line) for a ramp flag, (None, None)
    without one. ConfigError (one line) when the run would reach the ramp's next step."""
    ramp = getattr(args, "rampup_batch_size", None)
    schedule = getattr(args, "step_batch_size_schedule", None)
    if ramp is None and schedule is None:
        return None, None
    if ramp is not None:
        start, inc, samples = ramp
        steps = (args.global_batch_size - start) // inc
        next_at = samples / steps if steps else float("inf")  # samples where start + inc begins
        flag = f"--rampup-batch-size {start} {inc} {samples}"
    else:
        table = parse_schedule(schedule)
        start = table[0][1]
        next_at = table[1][0] / seq_length if len(table) > 1 else float("inf")
        flag = f'--step-batch-size-schedule "{schedule}"'
        if args.global_batch_size not in (None, max(b for _, b in table)):
            raise ConfigError(f"{flag} sets the global batch to its largest step "
                              f"({max(b for _, b in table)}): drop --global-batch-size "
                              f"{args.global_batch_size}")
    samples_total = getattr(args, "train_samples", None)
    iters = (-(-samples_total // start) if samples_total is not None else args.train_iters)
    last_start = (iters - 1) * start  # samples consumed before the last iteration
    if last_start >= next_at:
        change = int(next_at // start) + 1
        raise ConfigError(f"{flag}: the global batch would change at iteration {change} (sample "
                          f"{int(next_at)}) and this engine trains with one global batch; train "
                          f"at most {change - 1} iterations, or drop the ramp and give "
                          "--global-batch-size")
    return start, (f"megatron-2bw: {flag}: all {iters} iterations stay on the first step, "
                   f"global batch {start} (the next step would start at sample {next_at:.0f})")
