"""Megatron's batch-size ramps, with the arithmetic of Megatron's num-microbatches calculator.

    --rampup-batch-size START INCREMENT SAMPLES   megatron-core's RampupBatchsize calculator: after
        c consumed samples the global batch is START + int(c / (SAMPLES / n)) x INCREMENT
        (n = (B - START) / INCREMENT increments, B = --global-batch-size), and B once c > SAMPLES
    --step-batch-size-schedule "T0:B0 T1:B1 ..."  Megatron-LM's StepBatchsize calculator: batch Bi
        from Ti tokens on (K/M/B/T suffixes; a threshold counts int(Ti) // --seq-length samples,
        the entries are sorted, the first must be 0 samples); the largest Bi is the global batch
    --decrease-batch-size-if-needed                each batch runs rounded down to a multiple of
        micro batch x data-parallel size (b x w); without it a batch the run reaches that is not
        one is refused (Megatron asserts it; the schedule excludes the flag, as Megatron's does)

Like Megatron's training loop, the batch of an iteration is the calculator's answer at the
samples consumed before it, and a run consumes what it ran (the rounded batch). `nominal_batch`
and `running_batch` are that arithmetic; `batch_stretches` cuts a run into stretches of equal
running batch (a binary search per stretch: the batch never falls, Megatron's loop asserts it);
`BatchPlan` answers for any iteration its batch, m and consumed samples, and for any microbatch
of a replica which batch it belongs to. The config owns m (config/schema.py `num_microbatches`,
`Config.num_microbatches_at`, `Config.batch_plan`); `train_iterations` is Megatron's
--train-samples count (training.py `update_train_iters`). The engine runs one schedule segment per
stretch (pipeline/engine.py), the data hands out samples consumed .. consumed + B
(data/mock.py), the lr follows the consumed samples (optim/lr.py), checkpoints record them.
The refusals and the log line are in ramp_checks.py.
"""
from __future__ import annotations

import argparse
import bisect
from typing import NamedTuple

SUFFIXES = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}


def add_ramp_args(g) -> None:
    g.add_argument("--rampup-batch-size", nargs=3, type=int, default=None,
                   metavar=("START", "INCREMENT", "SAMPLES"),
                   help="Megatron's batch-size ramp: the global batch grows from START by "
                        "INCREMENT, evenly over SAMPLES samples, to --global-batch-size")
    g.add_argument("--step-batch-size-schedule", default=None, metavar='"T0:B0 T1:B1 ..."',
                   help="Megatron's stepped global batch: Bi from Ti tokens on (K/M/B/T "
                        "suffixes, T0 = 0); the largest Bi is the global batch")
    g.add_argument("--decrease-batch-size-if-needed", action="store_true",
                   help="Megatron's: run each global batch rounded down to a multiple of "
                        "micro batch x data-parallel size (with --rampup-batch-size or a constant "
                        "global batch)")


def parse_count(text: str) -> int:
    """Megatron's number with an optional K/M/B/T suffix: int(float(x) * suffix)."""
    text = text.strip().upper()
    scale = SUFFIXES.get(text[-1:], 1)
    return int(float(text[:-1] if scale != 1 else text) * scale)


def parse_schedule(text: str) -> tuple[tuple[int, int], ...]:
    """((threshold in tokens, global batch), ...) of a --step-batch-size-schedule, sorted by
    threshold as Megatron sorts them; ValueError on an entry that is not THRESHOLD:BATCH."""
    steps = []
    for part in text.replace(",", " ").split():
        threshold, sep, batch = part.partition(":")
        if not sep:
            raise ValueError(part)
        steps.append((parse_count(threshold), parse_count(batch)))
    if not steps or any(t < 0 or b < 1 for t, b in steps):
        raise ValueError(text)
    return tuple(sorted(steps, key=lambda s: s[0]))


def batch_ramp_problems(args: argparse.Namespace) -> list[str]:
    """Format errors of the ramp flags (one line each), for the parser's one message."""
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
            table = parse_schedule(schedule)
        except ValueError:
            out.append(f'--step-batch-size-schedule "{schedule}": give "0:B0 T1:B1 ..." '
                       "(token thresholds with K/M/B/T suffixes, global batches >= 1)")
        else:
            top = max(b for _, b in table)
            if args.global_batch_size not in (None, top):
                out.append(f'--step-batch-size-schedule "{schedule}" sets the global batch to '
                           f"its largest step ({top}): drop --global-batch-size "
                           f"{args.global_batch_size}")
    return out


def ramp_fields(args: argparse.Namespace) -> dict:
    """The BatchConfig fields of the batch flags: --global-batch-size (a schedule's largest
    batch) and the ramp as typed."""
    ramp = getattr(args, "rampup_batch_size", None)
    text = getattr(args, "step_batch_size_schedule", None)
    schedule = parse_schedule(text) if text is not None else None
    top = max(b for _, b in schedule) if schedule else None
    given = args.global_batch_size
    return {"global_batch_size": given if given is not None else top,
            "rampup_batch_size": tuple(ramp) if ramp is not None else None,
            "step_batch_size_schedule": schedule,
            "decrease_batch_size_if_needed": getattr(args, "decrease_batch_size_if_needed",
                                                     False)}


# -- Megatron's calculator -----------------------------------------------------------------------
def schedule_samples(batch, seq_length: int) -> tuple[tuple[int, int], ...]:
    """A step schedule's thresholds in samples: tokens // --seq-length (Megatron's)."""
    return tuple((t // seq_length, b) for t, b in batch.step_batch_size_schedule)


def nominal_batch(batch, seq_length: int, consumed: int) -> int:
    """Megatron's current global batch after `consumed` samples (`batch`: a BatchConfig)."""
    final = batch.global_batch_size
    if batch.rampup_batch_size is not None:
        start, inc, samples = batch.rampup_batch_size
        increments = (final - start) // inc
        if consumed > samples or increments <= 0 or samples == 0:
            return final  # (START = B, or a ramp over no samples: Megatron divides by zero)
        return start + int(consumed / (samples / increments)) * inc
    if batch.step_batch_size_schedule is not None:
        out = None
        for threshold, b in schedule_samples(batch, seq_length):
            if consumed >= threshold or out is None:
                out = b
        return out
    return final


def settled(batch, seq_length: int) -> int:
    """Consumed samples from which the nominal batch is the last one (0: no ramp)."""
    if batch.rampup_batch_size is not None:
        return batch.rampup_batch_size[2] + 1
    if batch.step_batch_size_schedule is not None:
        return schedule_samples(batch, seq_length)[-1][0]
    return 0


def running_batch(batch, seq_length: int, unit: int, consumed: int) -> int:
    """The global batch the iteration after `consumed` samples runs: the nominal one, rounded
    down to a multiple of `unit` = b x w with --decrease-batch-size-if-needed."""
    nominal = nominal_batch(batch, seq_length, consumed)
    return nominal // unit * unit if batch.decrease_batch_size_if_needed else nominal


def _runs(batch_at, settle: int, consumed: int = 0):
    """(consumed, batch, iterations or None: for ever) of each run of equal `batch_at` values
    from `consumed` on, each iteration consuming its batch. `batch_at` never falls."""
    while True:
        b = batch_at(consumed)
        if b < 1:
            raise ValueError(f"a global batch of {b} after {consumed} samples")
        if consumed >= settle or batch_at(max(settle, consumed)) == b:
            yield consumed, b, None
            return
        lo, hi = 0, -(-(settle - consumed) // b)  # batch_at(consumed + hi * b) != b
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if batch_at(consumed + mid * b) == b else (lo, mid)
        yield consumed, b, hi
        consumed += hi * b


def batch_stretches(batch, seq_length: int, unit: int) -> list[tuple[int, int, int]]:
    """[(first iteration, samples consumed before it, running global batch)] of the stretches
    of equal running batch; the last lasts for ever. ValueError if the batch ever falls or is
    rounded down to nothing."""
    out, first = [], 0
    for consumed, b, count in _runs(lambda c: running_batch(batch, seq_length, unit, c),
                                    settled(batch, seq_length)):
        if out and b < out[-1][2]:
            raise ValueError(f"the global batch falls from {out[-1][2]} to {b}")
        out.append((first, consumed, b))
        first += count or 0
    return out


def train_iterations(batch, seq_length: int, samples: int) -> int:
    """Megatron's --train-samples iteration count with a ramp (training.py `update_train_iters`,
    on the nominal batches): --rampup-batch-size counts the iterations that start at or before
    SAMPLES (and --train-samples) consumed, then whole final batches of the rest; a step
    schedule counts the iterations that start before --train-samples."""
    count, consumed = 0, 0
    ramp = batch.rampup_batch_size
    bound = min(ramp[2], samples) if ramp is not None else samples - 1
    for start, b, run in _runs(lambda c: nominal_batch(batch, seq_length, c),
                               settled(batch, seq_length)):
        if start > bound:
            break
        take = (bound - start) // b + 1  # iterations starting at or before `bound`
        take = take if run is None else min(take, run)
        count, consumed = count + take, start + take * b
        if run is None or take < run:
            break
    if ramp is not None and samples > consumed:
        count += (samples - consumed) // batch.global_batch_size
    return count


# -- the plan of a run ---------------------------------------------------------------------------
class Stretch(NamedTuple):
    first: int       # its first batch (0-based iteration)
    consumed: int    # samples consumed before it
    batch: int       # the global batch each of its batches runs
    m: int           # microbatches per batch per replica (the config's answer)
    microbatch: int  # microbatches of each replica before it


class BatchPlan:
    """The batches of a run: `stretches` of equal global batch (one when it does not ramp; the
    last lasts for ever), `unit` = micro batch x data-parallel size. Built by the config
    (`Config.batch_plan`); every question is a bisect over the stretches."""

    def __init__(self, stretches, unit: int):
        self.stretches, self.unit = tuple(Stretch(*s) for s in stretches), unit
        self._firsts = [s.first for s in self.stretches]
        self._microbatches = [s.microbatch for s in self.stretches]

    def __repr__(self) -> str:
        return "BatchPlan(" + ", ".join(f"{s.batch}@{s.first}" for s in self.stretches) + ")"

    @property
    def ramps(self) -> bool:
        return len(self.stretches) > 1

    def stretch(self, t: int) -> Stretch:
        return self.stretches[bisect.bisect_right(self._firsts, t) - 1]

    def m(self, t: int) -> int:
        """Microbatches per replica of batch t."""
        return self.stretch(t).m

    def batch(self, t: int) -> int:
        """The global batch batch t runs."""
        return self.stretch(t).batch

    def consumed(self, t: int) -> int:
        """Samples consumed before batch t (by t batches)."""
        s = self.stretch(t)
        return s.consumed + (t - s.first) * s.batch

    def next_change(self, t: int) -> int | None:
        """The first batch after t with another m (None: none)."""
        i = bisect.bisect_right(self._firsts, t)
        return self._firsts[i] if i < len(self._firsts) else None

    def microbatch(self, t: int) -> int:
        """Microbatches of each replica before batch t."""
        s = self.stretch(t)
        return s.microbatch + (t - s.first) * s.m

    def locate(self, k: int) -> tuple[int, int]:
        """(batch, microbatch in it) of a replica's k-th microbatch (0-based)."""
        s = self.stretches[bisect.bisect_right(self._microbatches, k) - 1]
        t, j = divmod(k - s.microbatch, s.m)
        return s.first + t, j

    def reached(self, iterations: int) -> tuple[Stretch, ...]:
        """The stretches that batches 0 .. iterations - 1 run in."""
        return tuple(s for s in self.stretches if s.first < max(iterations, 1))


def plan_of(stretches, unit: int, m_of) -> BatchPlan:
    """The BatchPlan of `batch_stretches`' rows, `m_of(global batch)` the config's m."""
    rows, microbatch, prev = [], 0, None
    for first, consumed, b in stretches:
        if prev is not None:
            microbatch += (first - prev[0]) * prev[1]
        rows.append((first, consumed, b, m_of(b), microbatch))
        prev = (first, rows[-1][3])
    return BatchPlan(rows, unit)
