"""Schedule kinds: the one owner of every rule a pipeline schedule implies.

A kind is an object that generates its action tables and answers every question about them. The
engine, the simulator/validator, the planner's cost model, the config and DeepSpeed front doors,
the single-process reference, bench/ and tools/ ask the kind; none of them compares schedule
names or restates a rule (`tests/unit/test_rule_owners.py` fails if one does).

    name                 'gpipe', 'flush', '2bw': the --pipeline-schedule value
    num_slots            weight versions a stage holds (2BW: 2, the others 1)
    delay                versions between the newest and the one a batch uses: num_slots - 1
    slot_of_batch(t)     the slot batch t's forwards, backwards and gradient buffer use
    weight_of_batch(t)   k such that batch t runs forward and backward on W(k): max(t - delay, 0)
    step_writes_slot(t)  S(t) writes W(t+1) into the slot of the first batch that runs on it
    newest_slot(t)       the slot holding W(t) after t steps (eval, checkpoints)
    initial_slot_weights(t0)  W index in each slot when a segment starts at batch t0
    synchronous          batch t+1 runs on W(t+1): exact gradients, plain training's semantics
    flushes              the pipeline drains at every batch (no forward of batch t+1 before S(t))
    min_microbatches(d)  the fewest microbatches per batch with d stages (2BW: d)
    in_flight(d, m, s)   peak microbatches with F done and B not done on stage s (the stash)
    grad_buffers         fp32 gradient buffers a stage holds (today's 2BW: one per slot; its
                         `with_grad_buffers(1)` variant: one, which S(t) consumes and zeroes
                         before the stage's first backward of batch t+1)
    grad_buffers_of(s)   the same for stage s (2BW's `with_grad_buffers("first")`: one on stage
                         0, two on the others)
    grad_buffer_of_batch(t, s)  the gradient buffer batch t's backwards accumulate into
    segments             batches the planner simulates: steady state = makespan(b) - makespan(a)
    forwards_between_reduce_and_norm  forwards that hide R(t)'s all-reduce before N(t) waits
    stashes_logits       the last stage keeps each in-flight microbatch's fp32 logits beside
                         their softmax until its backward (GPipe: all forwards run first)
    microbatches_per_flush  GPipe's `with_microbatches_per_flush(k)` variant: each batch runs
                         as flushes of at most k microbatches (in_flight k), one step per batch;
                         None: one flush of all m (every other kind: not applicable)
    stage_actions(s, d, m, T, t0)     stage s's table for batches t0 .. t0+T-1 (generators.py)

Every rule follows from `num_slots` where it can (the slot of batch t is t % num_slots, once,
here); the rest are per-kind attributes that `tests/unit/test_schedules.py` proves against the
kind's own tables. To add a schedule: write its table generator in generators.py, subclass
`ScheduleKind` here and `register_kind` an instance; nothing else changes.
"""
from __future__ import annotations

from functools import lru_cache

from megatron_2bw.schedule import generators

FIRST_STAGE = "first"  # --2bw-grad-buffers first: one buffer on stage 0, two on the others
DEFAULT_FIX = ("raise --global-batch-size or lower --micro-batch-size (or use fewer pipeline "
               "stages)")


class ScheduleKind:
    name = ""
    num_slots = 1
    grad_buffers_choices = (1,)  # what `with_grad_buffers` accepts (the first is the default)
    is_training = True
    segments = (1, 2)
    forwards_between_reduce_and_norm = 0
    stashes_logits = False

    def __repr__(self) -> str:
        return f"<schedule kind {self.name}>"

    # ---- the table ----
    generator = None  # a generators.py function (s, d, m, T, t0, slot) -> stage s's list

    def stage_actions(self, s: int, d: int, m: int, T: int, t0: int) -> list:
        return self.generator(s, d, m, T, t0, self.slot_of_microbatch(m))

    def slot_of_microbatch(self, m: int):
        """k -> the slot of microbatch k when a batch holds m microbatches."""
        return lambda k: self.slot_of_batch(k // m)

    # ---- weight versions ----
    @property
    def delay(self) -> int:
        return self.num_slots - 1

    def slot_of_batch(self, t: int) -> int:
        return t % self.num_slots

    def weight_of_batch(self, t: int) -> int:
        return max(t - self.delay, 0)

    def step_writes_slot(self, t: int) -> int:
        """S(t) writes W(t+1) where batch t + num_slots, the first to run on it, looks; in 2BW it
        reads W(t) from the other slot."""
        return self.slot_of_batch(t + self.num_slots)

    def newest_slot(self, t: int) -> int:
        return self.slot_of_batch(t + self.delay)

    # ---- gradient buffers ----
    @property
    def grad_buffers(self) -> int:
        return self.num_slots

    def grad_buffers_of(self, stage: int) -> int:
        return self.grad_buffers

    def grad_buffer_of_batch(self, t: int, stage: int = 0) -> int:
        return t % self.grad_buffers_of(stage)

    def with_grad_buffers(self, g: int | str | None) -> "ScheduleKind":
        """This kind with `g` fp32 gradient buffers per stage (None: its default); a one-line
        ValueError when it has no such mode."""
        if g is None or g == self.grad_buffers:
            return self
        raise ValueError(f"--2bw-grad-buffers {g} does not apply to --pipeline-schedule "
                         f"{self.name} (it holds {self.grad_buffers} gradient buffer"
                         f"{'s' * (self.grad_buffers != 1)}): drop --2bw-grad-buffers, or use "
                         f"--pipeline-schedule {DEFAULT_SCHEDULE}")

    microbatches_per_flush = None
    splits_into_flushes = False  # `with_microbatches_per_flush` has variants (GPipe)

    def with_microbatches_per_flush(self, k: int | None) -> "ScheduleKind":
        """This kind running each batch in flushes of at most `k` microbatches (None: its
        default); a one-line ValueError when it has no such mode."""
        if k is None:
            return self
        raise ValueError(f"--gpipe-microbatches-per-flush applies to --pipeline-schedule "
                         f"{GPipe.name} only, not {self.name}: drop it, or use "
                         f"--pipeline-schedule {GPipe.name}")

    def initial_slot_weights(self, t0: int) -> list:
        w = [0] * self.num_slots
        for t in range(t0, t0 + self.num_slots):
            w[self.slot_of_batch(t)] = self.weight_of_batch(t)
        return w

    def phase(self, t0: int) -> int:
        """Segments starting at batches of the same phase are translated copies of each other
        (the validator's verdict on one holds for the other)."""
        n = self.num_slots
        return t0 if t0 < n else n + t0 % n

    @property
    def synchronous(self) -> bool:
        return self.delay == 0  # batch t+1 runs on W(t+1): gradients are never stale

    @property
    def flushes(self) -> bool:
        return self.synchronous  # batch t+1 runs on W(t+1): it must wait for S(t)

    # ---- sizes ----
    def min_microbatches(self, d: int) -> int:
        return 1

    def microbatch_error(self, d: int, m: int, fix: str = DEFAULT_FIX) -> str | None:
        """A one-line error if m microbatches per batch are too few for d stages, else None."""
        low = self.min_microbatches(d)
        if m >= low:
            return None
        return (f"{self.name} needs at least {low} microbatches per batch with {d} pipeline "
                f"stages (m={m}): {fix}")

    def check_microbatches(self, d: int, m: int, fix: str = DEFAULT_FIX) -> None:
        msg = self.microbatch_error(d, m, fix)
        if msg:
            raise ValueError(msg)

    def accepts(self, d: int, m: int) -> bool:
        return self.microbatch_error(d, m) is None

    def in_flight(self, d: int, m: int, s: int) -> int:
        raise NotImplementedError

    # ---- one pipeline stage ----
    def one_stage_warning(self, d: int) -> str | None:
        """A one-line warning when this kind, asked for explicitly, gains nothing with d stages:
        a delayed (stale) gradient hides the pipeline's bubble, and one stage has none."""
        if d != 1 or self.synchronous:
            return None
        return (f"megatron-2bw: warning: --pipeline-schedule {self.name} with one pipeline stage "
                f"delays the gradient by {self.delay} step{'s' * (self.delay != 1)} for nothing (one stage has no "
                f"pipeline bubble to hide): use --pipeline-schedule {default_schedule(1)} for "
                "exact gradients at the same speed")


class GPipe(ScheduleKind):
    name = "gpipe"
    generator = staticmethod(generators.gpipe)
    stashes_logits = True
    splits_into_flushes = True

    def in_flight(self, d, m, s):
        return m

    def with_microbatches_per_flush(self, k):
        if k is None:
            return self
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"--gpipe-microbatches-per-flush must be a positive integer, got "
                             f"{k!r}")
        if k not in _GPIPE_IN_FLUSHES:
            _GPIPE_IN_FLUSHES[k] = GPipeInFlushes(k)
        return _GPIPE_IN_FLUSHES[k]


class GPipeInFlushes(GPipe):
    """GPipe admitting at most k microbatches at a time (`--gpipe-microbatches-per-flush k`):
    each batch runs as ceil(m / k) GPipe flushes whose gradients accumulate, one step per batch
    (`generators.gpipe_in_flushes`). The same weights and numbers as GPipe; k microbatches'
    activations in flight instead of m, for (ceil(m / k) - 1) more pipeline fills. Not
    registered: asked for by `GPipe().with_microbatches_per_flush(k)`, it answers to the name
    gpipe."""

    def __init__(self, per_flush: int):
        self.microbatches_per_flush = per_flush

    def __repr__(self) -> str:
        return f"<schedule kind {self.name} (flushes of {self.microbatches_per_flush})>"

    def stage_actions(self, s, d, m, T, t0):
        return generators.gpipe_in_flushes(s, d, m, T, t0, self.slot_of_microbatch(m),
                                           self.microbatches_per_flush)

    def in_flight(self, d, m, s):
        return min(self.microbatches_per_flush, m)


_GPIPE_IN_FLUSHES: dict[int, GPipeInFlushes] = {}


class Flush(ScheduleKind):
    name = "flush"
    generator = staticmethod(generators.flush)

    def in_flight(self, d, m, s):
        return min(d - s, m)  # 1F1B: the warm-up's d - 1 - s forwards, then one more


class TwoBW(Flush):
    """PipeDream-2BW: no flush, two versions, batch t runs on W(max(t - 1, 0))."""
    name = "2bw"
    num_slots = 2
    segments = (3, 4)  # the warm-up happens once: compare two segments past it
    forwards_between_reduce_and_norm = 1  # N(t) follows the first forward after R(t)
    generator = staticmethod(generators.twobw)

    grad_buffers_choices = (2, 1, FIRST_STAGE)

    def min_microbatches(self, d):
        return d  # S(t) must fit before batch t+2's first forward on every stage

    def microbatch_error(self, d, m, fix=DEFAULT_FIX):
        if m >= self.min_microbatches(d):
            return None
        return (f"{self.name} needs at least as many microbatches per batch as pipeline stages "
                f"(m={m} < d={d}): {fix}")

    def with_grad_buffers(self, g):
        if g is None or g == self.grad_buffers:
            return self
        if g not in self.grad_buffers_choices:
            raise ValueError(f"--2bw-grad-buffers must be one of "
                             f"{', '.join(map(str, self.grad_buffers_choices))}, got {g}")
        if g == FIRST_STAGE:
            return _FIRST_STAGE_ONE_BUFFER_2BW
        return _ONE_BUFFER_2BW if g == 1 else schedule_kind(self.name)  # (the variant asked: 2)


class TwoBWOneBuffer(TwoBW):
    """2BW with one fp32 gradient buffer per stage (`--2bw-grad-buffers 1`): the same versions,
    steps and numbers, but S(t) runs before the stage's first backward of batch t+1 (which would
    accumulate into the buffer S(t) reads and zeroes), so the stage waits there for N(t)'s
    all-reduce; the table is `generators.twobw_one_buffer`. Not registered: asked for by
    `TwoBW().with_grad_buffers(1)`, it answers to the name 2bw."""
    generator = staticmethod(generators.twobw_one_buffer)

    def __repr__(self) -> str:
        return f"<schedule kind {self.name} (one gradient buffer)>"

    @property
    def grad_buffers(self) -> int:
        return 1


class TwoBWFirstStageOneBuffer(TwoBW):
    """2BW with one fp32 gradient buffer on stage 0 and two on every other stage
    (`--2bw-grad-buffers first`): the same versions, steps and numbers; stage 0's S(t) runs
    right before its first backward of batch t+1 (`generators.twobw_first_stage_one_buffer`).
    Stage 0 is the last to post N(t), so it waits there for that all-reduce's latency only,
    while it is the stage that keeps the most microbatches in flight (d): its memory drops by a
    buffer at about no time. (Stages > 0 cannot join it: their S(t) before that backward would
    put the gradient of microbatch (t+1)m in two windows of a channel, or wait for N(t).) Not
    registered: asked for by `TwoBW().with_grad_buffers("first")`, it answers to the name 2bw."""
    generator = staticmethod(generators.twobw_first_stage_one_buffer)

    def __repr__(self) -> str:
        return f"<schedule kind {self.name} (one gradient buffer on the first stage)>"

    @property
    def grad_buffers(self) -> str:
        return FIRST_STAGE

    def grad_buffers_of(self, stage: int) -> int:
        return 1 if stage == 0 else 2


class ForwardOnly(ScheduleKind):
    """Eval (`forward_only()`): forwards on slot 0, no backward, no step."""
    name = "forward"
    is_training = False
    generator = staticmethod(generators.forward)

    def in_flight(self, d, m, s):
        return m


# ---- the registry ------------------------------------------------------------------------------

_KINDS: dict[str, ScheduleKind] = {}


def register_kind(kind: ScheduleKind) -> ScheduleKind:
    if not kind.name or kind.name in _KINDS:
        raise ValueError(f"schedule kind name {kind.name!r} is empty or already registered")
    _KINDS[kind.name] = kind
    return kind


def schedule_names() -> tuple:
    """The training schedules, in the order flags and reports list them."""
    return tuple(name for name, kind in _KINDS.items() if kind.is_training)


def schedule_kind(name) -> ScheduleKind:
    """The kind of `name` (a kind passes through); unknown names are one-line ValueErrors."""
    if isinstance(name, ScheduleKind):
        return name
    kind = _KINDS.get(name)
    if kind is None:
        raise ValueError(f"unknown schedule {name!r}; valid schedules: "
                         f"{', '.join(schedule_names())}")
    return kind


def default_schedule(num_stages: int) -> str:
    """The schedule when none is asked for: with one pipeline stage the synchronous flush (1F1B;
    a stale gradient would buy nothing), else PipeDream-2BW."""
    return Flush.name if num_stages == 1 else DEFAULT_SCHEDULE


def one_stage_note(num_stages: int) -> str:
    """The log line saying that the default schedule at one stage is synchronous."""
    return (f"megatron-2bw: one pipeline stage: schedule {default_schedule(num_stages)} "
            f"(synchronous, exact gradients; {DEFAULT_SCHEDULE} would only delay the gradient); "
            "--pipeline-schedule chooses another")


@lru_cache(maxsize=None)  # kinds are immutable; the planner asks this per stage and layout
def schedule_kind_of(name, grad_buffers: int | None = None,
                     microbatches_per_flush: int | None = None) -> ScheduleKind:
    """The kind of `name` with `grad_buffers` fp32 gradient buffers per stage and (GPipe) at
    most `microbatches_per_flush` microbatches per flush (None: the kind's defaults); one-line
    ValueErrors."""
    kind = schedule_kind(name).with_grad_buffers(grad_buffers)
    return kind.with_microbatches_per_flush(microbatches_per_flush)


def kind_with_slots(num_slots: int) -> ScheduleKind:
    """The first training kind holding `num_slots` versions (bare tables: `Schedule.from_table`)."""
    for kind in _KINDS.values():
        if kind.is_training and kind.num_slots == num_slots:
            return kind
    raise ValueError(f"no schedule holds {num_slots} weight versions")


for _kind in (TwoBW(), Flush(), GPipe(), ForwardOnly()):
    register_kind(_kind)
_ONE_BUFFER_2BW = TwoBWOneBuffer()
_FIRST_STAGE_ONE_BUFFER_2BW = TwoBWFirstStageOneBuffer()
DEFAULT_SCHEDULE = TwoBW.name
FORWARD_ONLY = ForwardOnly.name

__all__ = ["ScheduleKind", "GPipe", "GPipeInFlushes", "Flush", "TwoBW", "TwoBWOneBuffer",
           "TwoBWFirstStageOneBuffer", "FIRST_STAGE", "ForwardOnly",
           "register_kind", "schedule_names", "schedule_kind", "schedule_kind_of",
           "kind_with_slots", "DEFAULT_SCHEDULE",
           "default_schedule", "one_stage_note",
           "FORWARD_ONLY", "DEFAULT_FIX"]
