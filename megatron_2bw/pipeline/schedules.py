"""Pipeline schedules: pure action tables (one ordered list of `Action`s per stage).

Three training schedules and one eval schedule, all written in the vocabulary of `actions.py`:

    gpipe    all forwards of a batch, then all backwards (reverse order), then R N S.
    flush    Megatron's 1F1B with a flush at every batch boundary (PipeDream-Flush).
    2bw      PipeDream-2BW: 1F1B run continuously over the whole segment, two weight versions.
    forward  forward_only(): ra F sa for every microbatch (eval).

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

from .actions import BACKWARD, FORWARD, STEP, Action, B, F, N, R, RA, RG, S, SA, SG

KINDS = ("gpipe", "flush", "2bw")
FORWARD_ONLY = "forward"
_SMALL = 4  # batches materialized by a lazy Schedule


def _check_sizes(d: int, m: int, T: int, t0: int) -> None:
    for name, value, low in (("num_stages", d, 1), ("num_microbatches", m, 1),
                             ("num_batches", T, 1), ("first_batch", t0, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def check_2bw(d: int, m: int) -> None:
    if m < d:
        raise ValueError(
            f"2bw needs at least as many microbatches per batch as pipeline stages (m={m} < d={d}): "
            f"raise --global-batch-size or lower --micro-batch-size (or use fewer pipeline stages)")


# ---------------------------------------------------------------------------------------------
# generators: each returns the full list of one stage


def _one_f_one_b(s: int, d: int, mbs: list, ver) -> list:
    """Megatron's 1F1B over `mbs` on stage s (warm-up, steady 1F1B, cool-down)."""
    first, last = s == 0, s == d - 1
    n = len(mbs)
    out = []
    warm = min(d - 1 - s, n)
    for k in mbs[:warm]:
        if not first:
            out.append(RA(k))
        out.append(F(k, ver(k)))
        if not last:
            out.append(SA(k))
    rem = n - warm
    if rem and not first:
        out.append(RA(mbs[warm]))
    for i in range(rem):
        f, b = mbs[warm + i], mbs[i]
        out.append(F(f, ver(f)))
        if not last:
            out += [SA(f), RG(b)]
        out.append(B(b, ver(b)))
        if not first:
            out.append(SG(b))
            if i != rem - 1:
                out.append(RA(mbs[warm + i + 1]))
    for b in mbs[rem:]:
        if not last:
            out.append(RG(b))
        out.append(B(b, ver(b)))
        if not first:
            out.append(SG(b))
    return out


def _gpipe_batch(s: int, d: int, mbs: list) -> list:
    out = []
    for k in mbs:
        if s > 0:
            out.append(RA(k))
        out.append(F(k, 0))
        if s < d - 1:
            out.append(SA(k))
    for k in reversed(mbs):
        if s < d - 1:
            out.append(RG(k))
        out.append(B(k, 0))
        if s > 0:
            out.append(SG(k))
    return out


def gpipe_stage(s: int, d: int, m: int, T: int = 1, t0: int = 0) -> list:
    out = []
    for t in range(t0, t0 + T):
        out += _gpipe_batch(s, d, list(range(t * m, (t + 1) * m)))
        out += [R(t), N(t), S(t)]
    return out


def flush_stage(s: int, d: int, m: int, T: int = 1, t0: int = 0) -> list:
    out = []
    for t in range(t0, t0 + T):
        out += _one_f_one_b(s, d, list(range(t * m, (t + 1) * m)), lambda k: 0)
        out += [R(t), N(t), S(t)]
    return out


def twobw_stage(s: int, d: int, m: int, T: int = 1, t0: int = 0) -> list:
    """1F1B over the whole segment, then R/N/S inserted:

    R(t) right after B of the batch's last microbatch; S(t) right after B((t+2)m - d + s) (the last
    backward before F of batch t+2, the first forward that needs W(t+1)), S(last) at the very end;
    N(t) right after the first compute action after R(t) (before S(t) in any case). Where one B
    carries both S(t-1) and R(t) (last stage), S(t-1) goes first so that R(t) opens window t.
    """
    check_2bw(d, m)
    base = _one_f_one_b(s, d, list(range(t0 * m, (t0 + T) * m)), lambda k: (k // m) % 2)
    last = t0 + T - 1
    out, pending = [], []
    for a in base:
        out.append(a)
        if not a.is_compute:
            continue
        out += [N(t) for t in pending]
        pending = []
        if a.kind == BACKWARD:
            if (a.mb + d - s) % m == 0 and t0 <= (a.mb + d - s) // m - 2 < last:
                out.append(S((a.mb + d - s) // m - 2))
            if (a.mb + 1) % m == 0:
                out.append(R((a.mb + 1) // m - 1))
                pending.append((a.mb + 1) // m - 1)
    out += [N(t) for t in pending]
    out.append(S(last))
    return out


_GENERATORS = {"gpipe": gpipe_stage, "flush": flush_stage, "2bw": twobw_stage}


def generate_table(name: str, num_stages: int, num_microbatches: int, num_batches: int = 1,
                   first_batch: int = 0) -> list:
    """Fully materialized table (list per stage); `Schedule` is the lazy front end."""
    if name not in _GENERATORS:
        raise ValueError(f"unknown schedule {name!r}; valid schedules: {', '.join(KINDS)}")
    _check_sizes(num_stages, num_microbatches, num_batches, first_batch)
    gen = _GENERATORS[name]
    return [gen(s, num_stages, num_microbatches, num_batches, first_batch)
            for s in range(num_stages)]


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
    """One schedule for a segment of `num_batches` batches starting at `first_batch`."""

    def __init__(self, name: str, num_stages: int, num_microbatches: int, num_batches: int = 1,
                 first_batch: int = 0, table: list | None = None):
        if name not in KINDS and name != FORWARD_ONLY:
            raise ValueError(f"unknown schedule {name!r}; valid schedules: {', '.join(KINDS)}")
        _check_sizes(num_stages, num_microbatches, num_batches, first_batch)
        if name == "2bw":
            check_2bw(num_stages, num_microbatches)
        if table is not None and len(table) != num_stages:
            raise ValueError(f"table has {len(table)} stages, expected {num_stages}")
        if name == FORWARD_ONLY and table is None:
            raise ValueError("use forward_only() to build a forward-only schedule")
        self.name = name
        self.num_stages = num_stages
        self.num_microbatches = num_microbatches
        self.num_batches = num_batches
        self.first_batch = first_batch
        self._custom = None if table is None else [list(acts) for acts in table]
        self._windows = None  # per stage: list of windows of the small (or custom) table

    def __repr__(self) -> str:
        return (f"Schedule({self.name!r}, num_stages={self.num_stages}, "
                f"num_microbatches={self.num_microbatches}, num_batches={self.num_batches}, "
                f"first_batch={self.first_batch}{', custom table' if self._custom else ''})")

    # ---- weight-version semantics ----
    @property
    def num_slots(self) -> int:
        return 2 if self.name == "2bw" else 1

    @property
    def is_training(self) -> bool:
        return self.name != FORWARD_ONLY

    def slot_of_batch(self, t: int) -> int:
        return t % 2 if self.name == "2bw" else 0

    def weight_of_batch(self, t: int) -> int:
        """k such that batch t runs forward and backward on W(k)."""
        return max(t - 1, 0) if self.name == "2bw" else t

    def step_writes_slot(self, t: int) -> int:
        """S(t) writes W(t+1) into this slot (it reads W(t) from the other one in 2bw)."""
        return t % 2 if self.name == "2bw" else 0

    def initial_slot_weights(self) -> list:
        t0 = self.first_batch
        if self.name != "2bw":
            return [t0]
        w = [0, 0]
        w[t0 % 2] = max(t0 - 1, 0)
        w[(t0 + 1) % 2] = t0
        return w

    def batch_of(self, mb: int) -> int:
        return mb // self.num_microbatches

    def microbatches(self) -> range:
        m = self.num_microbatches
        return range(self.first_batch * m, (self.first_batch + self.num_batches) * m)

    def with_table(self, table: list) -> "Schedule":
        """Same semantics, explicit (e.g. hand-edited) table."""
        return Schedule(self.name, self.num_stages, self.num_microbatches, self.num_batches,
                        self.first_batch, table=table)

    @classmethod
    def from_table(cls, table: list, name: str | None = None) -> "Schedule":
        """Guess the semantics of a bare table: batches from R/N/S, m from stage 0's forwards,
        '2bw' if any compute action uses slot 1 (else 'flush'), 'forward' if there is no S."""
        table = [list(acts) for acts in table]
        batches = {a.batch for acts in table for a in acts if a.batch >= 0}
        mbs = {a.mb for a in table[0] if a.kind == FORWARD} if table else set()
        if not batches:
            return cls(name or FORWARD_ONLY, len(table), max(len(mbs), 1), table=table)
        t0, T = min(batches), max(batches) - min(batches) + 1
        if name is None:
            name = "2bw" if any(a.is_compute and a.version == 1 for acts in table for a in acts) \
                else "flush"
        return cls(name, len(table), max(len(mbs) // T, 1), T, t0, table=table)

    # ---- the table ----
    def _small_windows(self) -> list:
        if self._windows is None:
            if self._custom is not None:
                tbl, nb = self._custom, self.num_batches
            else:
                nb = min(self.num_batches, _SMALL)
                tbl = generate_table(self.name, self.num_stages, self.num_microbatches, nb,
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
        m = self.num_microbatches
        ver = lambda mb: self.slot_of_batch(mb // m)  # noqa: E731
        return [a.shifted(k * m, k, ver) for a in wins[src]]

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
        """Max number of microbatches with F done and B not yet done on `stage` (order only).
        For generated schedules the 4-batch table has the same peak as any longer segment."""
        live = peak = 0
        acts = self._custom[stage] if self._custom is not None else \
            [a for w in self._small_windows()[stage] for a in w]
        for a in acts:
            if a.kind == FORWARD:
                live += 1
                peak = max(peak, live)
            elif a.kind == BACKWARD:
                live -= 1
        return peak

    def format(self) -> str:
        """Step-by-stage listing (labels, in list order)."""
        return "\n".join(f"s{s} | " + " ".join(a.label(s) for a in self.actions(s))
                         for s in range(self.num_stages))


def make_schedule(name: str, num_stages: int, num_microbatches: int, num_batches: int = 1,
                  first_batch: int = 0) -> Schedule:
    if name not in KINDS:
        raise ValueError(f"unknown schedule {name!r}; valid schedules: {', '.join(KINDS)}")
    return Schedule(name, num_stages, num_microbatches, num_batches, first_batch)


def forward_only(num_stages: int, num_microbatches: int) -> Schedule:
    """Eval: ra(k) F(k, v0) sa(k) for every microbatch on every stage (no B/R/N/S)."""
    _check_sizes(num_stages, num_microbatches, 1, 0)
    table = []
    for s in range(num_stages):
        acts = []
        for k in range(num_microbatches):
            if s > 0:
                acts.append(RA(k))
            acts.append(F(k, 0))
            if s < num_stages - 1:
                acts.append(SA(k))
        table.append(acts)
    return Schedule(FORWARD_ONLY, num_stages, num_microbatches, 1, 0, table=table)


__all__ = ["KINDS", "FORWARD_ONLY", "Schedule", "make_schedule", "forward_only",
           "generate_table", "split_windows", "check_2bw", "Action"]
