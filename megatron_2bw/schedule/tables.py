"""Pipeline schedules: pure action tables (one ordered list of `Action`s per stage).

A `Schedule` is a kind (`kinds.py`: gpipe, flush, 2bw, and forward for eval; each owns its
table generator and its rules) applied to d stages, m microbatches per batch and a segment of
batches. Tables are written in the vocabulary of `actions.py`.

Example (flush, d=2, m=3, one batch; '.' = idle, unit durations, see `simulate.format_grid`)::

    s0 |F0v0 F1v0 .    B0v0 F2v0 B1v0 .    B2v0 S0
    s1 |.    F0v0 B0v0 F1v0 B1v0 F2v0 B2v0 .    S0

Microbatch indices are global (batch t holds microbatches t*m .. t*m+m-1) and a schedule covers a
*segment* of `num_batches` batches starting at `first_batch` (> 0 after a resume). A *window* t of
a stage is its actions after S(t-1) up to and including S(t); every send/recv is matched inside one
window, so the engine may stop between windows (eval, checkpoint) with nothing in flight.
`Schedule.window` is cheap for huge segments: only `min(T, 4)` batches are ever materialized and
the middle windows are translated copies of a generic one (`Action.shifted`).
"""
from __future__ import annotations

from megatron_2bw.schedule.actions import BACKWARD, FORWARD, STEP, Action
from megatron_2bw.schedule.kinds import FORWARD_ONLY, ScheduleKind, kind_with_slots, schedule_kind

_SMALL = 4  # batches materialized by a lazy Schedule


def _check_sizes(d: int, m: int, T: int, t0: int) -> None:
    for name, value, low in (("num_stages", d, 1), ("num_microbatches", m, 1),
                             ("num_batches", T, 1), ("first_batch", t0, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def generate_table(kind, num_stages: int, num_microbatches: int, num_batches: int = 1,
                   first_batch: int = 0) -> list:
    """Fully materialized table (list per stage); `Schedule` is the lazy front end."""
    kind = schedule_kind(kind)
    _check_sizes(num_stages, num_microbatches, num_batches, first_batch)
    kind.check_microbatches(num_stages, num_microbatches)
    return [kind.stage_actions(s, num_stages, num_microbatches, num_batches, first_batch)
            for s in range(num_stages)]


def count_in_flight(actions: list) -> int:
    """Max number of microbatches with F done and B not yet done in one stage's list."""
    live = peak = 0
    for a in actions:
        if a.kind == FORWARD:
            live += 1
            peak = max(peak, live)
        elif a.kind == BACKWARD:
            live -= 1
    return peak


def split_windows(actions: list, first_batch: int, num_batches: int) -> list:
    """Cut one stage's list after every S: window t0, t0+1, ... (trailing actions join the last)."""
    windows, cur = [], []
    for a in actions:
        cur.append(a)
        if a.kind == STEP:
            windows.append(cur)
            cur = []
    if cur:
        if windows and len(windows) >= num_batches:
            windows[-1] = windows[-1] + cur
        else:
            windows.append(cur)
    while len(windows) < num_batches:
        windows.append([])
    return windows


# ---------------------------------------------------------------------------------------------


class Schedule:
    """One schedule for a segment of `num_batches` batches starting at `first_batch`: a kind
    (or its name) applied to a size, optionally with an explicit (e.g. hand-edited) table."""

    def __init__(self, kind, num_stages: int, num_microbatches: int, num_batches: int = 1,
                 first_batch: int = 0, table: list | None = None):
        self.kind: ScheduleKind = schedule_kind(kind)
        _check_sizes(num_stages, num_microbatches, num_batches, first_batch)
        self.kind.check_microbatches(num_stages, num_microbatches)
        if table is not None and len(table) != num_stages:
            raise ValueError(f"table has {len(table)} stages, expected {num_stages}")
        self.num_stages = num_stages
        self.num_microbatches = num_microbatches
        self.num_batches = num_batches
        self.first_batch = first_batch
        self._custom = None if table is None else [list(acts) for acts in table]
        self._windows = None  # per stage: list of windows of the small (or custom) table
        self.verdict = None   # the validator's, once asked (`simulate.check_schedule`)

    def __repr__(self) -> str:
        return (f"Schedule({self.name!r}, num_stages={self.num_stages}, "
                f"num_microbatches={self.num_microbatches}, num_batches={self.num_batches}, "
                f"first_batch={self.first_batch}{', custom table' if self._custom else ''})")

    @property
    def name(self) -> str:
        return self.kind.name

    @property
    def shape(self) -> tuple | None:
        """What the validator's verdict depends on (None for a custom table: it is its own)."""
        if self._custom is not None:
            return None
        return (self.kind, self.num_stages, self.num_microbatches,
                min(self.num_batches, _SMALL), self.kind.phase(self.first_batch))

    def materialized(self) -> "Schedule":
        """The schedule whose table every window is cut from: itself, or its first 4 batches
        (the windows of a longer segment are translated copies of those)."""
        if self._custom is not None or self.num_batches <= _SMALL:
            return self
        return Schedule(self.kind, self.num_stages, self.num_microbatches, _SMALL,
                        self.first_batch)

    # ---- weight-version semantics: the kind's ----
    @property
    def num_slots(self) -> int:
        return self.kind.num_slots

    @property
    def is_training(self) -> bool:
        return self.kind.is_training

    def slot_of_batch(self, t: int) -> int:
        return self.kind.slot_of_batch(t)

    @property
    def grad_buffers(self) -> int:
        return self.kind.grad_buffers

    def grad_buffers_of(self, stage: int) -> int:
        return self.kind.grad_buffers_of(stage)

    def grad_buffer_of_batch(self, t: int, stage: int = 0) -> int:
        return self.kind.grad_buffer_of_batch(t, stage)

    def weight_of_batch(self, t: int) -> int:
        """k such that batch t runs forward and backward on W(k)."""
        return self.kind.weight_of_batch(t)

    def step_writes_slot(self, t: int) -> int:
        """S(t) writes W(t+1) into this slot."""
        return self.kind.step_writes_slot(t)

    def initial_slot_weights(self) -> list:
        return self.kind.initial_slot_weights(self.first_batch)

    def batch_of(self, mb: int) -> int:
        return mb // self.num_microbatches

    def microbatches(self) -> range:
        m = self.num_microbatches
        return range(self.first_batch * m, (self.first_batch + self.num_batches) * m)

    def with_table(self, table: list) -> "Schedule":
        """Same semantics, explicit (e.g. hand-edited) table."""
        return Schedule(self.kind, self.num_stages, self.num_microbatches, self.num_batches,
                        self.first_batch, table=table)

    @classmethod
    def from_table(cls, table: list, kind=None) -> "Schedule":
        """Guess the semantics of a bare table: batches from R/N/S, m from stage 0's forwards,
        the first training kind with as many slots as the table uses, the forward-only kind if
        there is no S."""
        table = [list(acts) for acts in table]
        batches = {a.batch for acts in table for a in acts if a.batch >= 0}
        mbs = {a.mb for a in table[0] if a.kind == FORWARD} if table else set()
        if not batches:
            return cls(kind or FORWARD_ONLY, len(table), max(len(mbs), 1), table=table)
        t0, T = min(batches), max(batches) - min(batches) + 1
        if kind is None:
            kind = kind_with_slots(1 + max((a.version for acts in table for a in acts
                                            if a.is_compute), default=0))
        return cls(kind, len(table), max(len(mbs) // T, 1), T, t0, table=table)

    # ---- the table ----
    def _small_windows(self) -> list:
        if self._windows is None:
            if self._custom is not None:
                tbl, nb = self._custom, self.num_batches
            else:
                nb = min(self.num_batches, _SMALL)
                tbl = generate_table(self.kind, self.num_stages, self.num_microbatches, nb,
                                     self.first_batch)
            self._windows = [split_windows(acts, self.first_batch, nb) for acts in tbl]
        return self._windows

    def window(self, stage: int, t: int) -> list:
        """Actions of `stage` after S(t-1) up to and including S(t)."""
        if not 0 <= stage < self.num_stages:
            raise IndexError(f"stage {stage} out of range 0..{self.num_stages - 1}")
        rel, T = t - self.first_batch, self.num_batches
        if not 0 <= rel < T:
            raise IndexError(f"batch {t} is not in this segment "
                             f"({self.first_batch}..{self.first_batch + T - 1})")
        wins = self._small_windows()[stage]
        if self._custom is not None or T <= _SMALL:
            return list(wins[rel])
        # T > _SMALL: first window as is; the last two (the cool-down may reach into them) and the
        # middle ones are translated copies of windows of the 4-batch table.
        if rel == 0:
            return list(wins[0])
        src = rel - (T - _SMALL) if rel >= T - 2 else 1
        k = rel - src
        slot = self.kind.slot_of_microbatch(self.num_microbatches)
        return [a.shifted(k * self.num_microbatches, k, slot) for a in wins[src]]

    def windows(self, stage: int):
        for t in range(self.first_batch, self.first_batch + self.num_batches):
            yield self.window(stage, t)

    def actions(self, stage: int) -> list:
        if self._custom is not None:
            return list(self._custom[stage])
        return [a for w in self.windows(stage) for a in w]

    def table(self) -> list:
        return [self.actions(s) for s in range(self.num_stages)]

    def peak_in_flight(self, stage: int) -> int:
        """Max number of microbatches with F done and B not yet done on `stage` (order only):
        the kind's rule, or counted in a custom table."""
        if self._custom is not None:
            return count_in_flight(self._custom[stage])
        return self.kind.in_flight(self.num_stages, self.num_microbatches, stage)

    def format(self) -> str:
        """Step-by-stage listing (labels, in list order)."""
        return "\n".join(f"s{s} | " + " ".join(a.label(s) for a in self.actions(s))
                         for s in range(self.num_stages))


def make_schedule(kind, num_stages: int, num_microbatches: int, num_batches: int = 1,
                  first_batch: int = 0) -> Schedule:
    return Schedule(kind, num_stages, num_microbatches, num_batches, first_batch)


def forward_only(num_stages: int, num_microbatches: int) -> Schedule:
    """Eval: ra(k) F(k, v0) sa(k) for every microbatch on every stage (no B/R/N/S)."""
    return Schedule(FORWARD_ONLY, num_stages, num_microbatches)


__all__ = ["FORWARD_ONLY", "Schedule", "make_schedule", "forward_only", "generate_table",
           "split_windows", "count_in_flight", "Action"]
