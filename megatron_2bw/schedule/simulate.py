"""Event-driven simulator of a schedule; it is also the validator.

Every stage runs its action list in order. F/B/R/N/S take `durations[kind]` (default F=1, B=2,
others 0; a dict, or a callable (stage, action) -> float). Consecutive ra/sa/rg/sg form one group:
the stage posts them together and is blocked until every op has been matched by its partner having
*posted* the partner op (rendezvous, FIFO per channel); the group completes when the last partner
posted, plus `comm_latency` (a number, or a callable (stage, action) -> seconds giving each op its
own transfer time; the group then completes when its slowest op does). R(t) posts this stage's part of the tied-gradient collective tied(t)
(stages 0 and d-1 when d > 1); N(t) posts norm(t) (all stages), on stage 0 after waiting for
tied(t) from stage d-1; S(t) waits for norm(t) from everybody and, on stage d-1, for tied(t) from
stage 0. Collective waits complete when the last participant posted.

Any broken rule raises `ScheduleError` with a one-line message "stage S step I (LABEL): what" and
the partial grid up to the failure as `.grid` (among them: a backward of batch t before S(t - g)
on its stage, g the kind's gradient buffers per stage, since batch t - g's gradient is still in
the buffer batch t accumulates into); a deadlock names every blocked stage and what it
waits for. `check_schedule` is what the engine asks before it runs a window: the same validator,
its verdict cached per schedule shape.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from megatron_2bw.schedule.actions import (BACKWARD, FORWARD, NORM, RECV_ACT, RECV_GRAD, REDUCE,
                                           SEND_ACT, SEND_GRAD, STEP, Action)
from megatron_2bw.schedule.render import render_timeline
from megatron_2bw.schedule.tables import Schedule

DEFAULT_DURATIONS = {FORWARD: 1.0, BACKWARD: 2.0, STEP: 0.0, REDUCE: 0.0, NORM: 0.0}


class ScheduleError(ValueError):
    """A schedule breaks a rule or deadlocks. `.grid` shows the simulation up to the failure."""

    def __init__(self, message: str, grid: str = ""):
        super().__init__(message)
        self.grid = grid


@dataclass
class SimResult:
    schedule: Schedule
    timeline: list            # per stage: [(start, end, Action)] in execution order (comm too)
    makespan: float
    busy: list                # per stage: time spent in F/B/R/N/S
    bubble_fraction: list     # per stage: idle / makespan
    peak_in_flight: list      # per stage: max #microbatches with F done and B not done (the
                              # schedule's, `Schedule.peak_in_flight`)
    slot_weights: list = field(default_factory=list)  # per stage: final W index in each slot

    @property
    def bubble(self) -> float:
        """Mean bubble fraction over the stages."""
        return sum(self.bubble_fraction) / len(self.bubble_fraction)

    def grid(self) -> str:
        return render_timeline(self.timeline)


class _Post:
    __slots__ = ("stage", "step", "action", "time", "window")

    def __init__(self, stage, step, action, time, window):
        self.stage, self.step, self.action, self.time, self.window = stage, step, action, time, window


class _Stage:
    def __init__(self, idx: int, acts: list, slots: list, t0: int):
        self.idx, self.acts, self.slots = idx, acts, slots
        self.pc, self.clock, self.busy = 0, 0.0, 0.0
        self.group = None          # posted, not yet completed: [(step, action, post, other_list)]
        self.f = {}                # mb -> (slot, weight) used by its forward
        self.b = set()
        self.recv_done = {RECV_ACT: set(), RECV_GRAD: set()}
        self.posted = {k: set() for k in (RECV_ACT, SEND_ACT, RECV_GRAD, SEND_GRAD)}
        self.next = {REDUCE: t0, NORM: t0, STEP: t0}
        self.window = t0           # t0 + number of S done
        self.b_per_batch = {}
        self.timeline = []
        self.wait = ""             # what a blocked stage waits for
        self.wait_step = 0         # the op of a posted group it waits on


class _Sim:
    def __init__(self, sched: Schedule, durations, comm_latency):
        self.sched, self.d, self.m = sched, sched.num_stages, sched.num_microbatches
        self.t0, self.T = sched.first_batch, sched.num_batches
        self.segment = sched.microbatches()
        if callable(durations):
            self.dur = durations
        else:
            table = dict(DEFAULT_DURATIONS, **(durations or {}))
            self.dur = lambda stage, a: table.get(a.kind, 0.0)
        self.latency = comm_latency
        init = sched.initial_slot_weights()
        self.stages = [_Stage(s, sched.actions(s), list(init), self.t0) for s in range(self.d)]
        # channel c carries activations c -> c+1 and gradients c+1 -> c: [send posts, recv posts]
        self.act = [([], []) for _ in range(max(self.d - 1, 0))]
        self.grad = [([], []) for _ in range(max(self.d - 1, 0))]
        self.tied, self.norm = {}, {}   # batch -> {stage: post time}

    # ---- errors ----
    def fail(self, st: _Stage, step: int, msg: str, marks=None):
        label = st.acts[step].label(st.idx) if step < len(st.acts) else "end"
        grid = render_timeline([x.timeline for x in self.stages],
                               marks or {st.idx: f"<-- step {step} ({label}) fails"})
        raise ScheduleError(f"stage {st.idx} step {step} ({label}): {msg}", grid)

    # ---- main loop ----
    def run(self) -> SimResult:
        heap = [(0.0, s) for s in range(self.d)]
        blocked = set()
        while heap:
            _, s = heapq.heappop(heap)
            st = self.stages[s]
            state, woken = self.step(st)
            for w in woken:
                if w in blocked:
                    blocked.discard(w)
                    heapq.heappush(heap, (self.stages[w].clock, w))
            if state == "progress":
                heapq.heappush(heap, (st.clock, s))
            elif state == "blocked":
                blocked.add(s)
        if blocked:
            at = {s: self.stages[s].wait_step if self.stages[s].group else self.stages[s].pc
                  for s in blocked}
            parts = [f"stage {s} step {at[s]} ({self.stages[s].acts[at[s]].label(s)}) waits for "
                     f"{self.stages[s].wait}" for s in sorted(blocked)]
            marks = {s: f"<-- blocked at step {at[s]} "
                        f"({self.stages[s].acts[at[s]].label(s)})" for s in blocked}
            grid = render_timeline([x.timeline for x in self.stages], marks)
            raise ScheduleError("deadlock: " + "; ".join(parts), grid)
        self.final_checks()
        return self.result()

    def step(self, st: _Stage):
        """Try to run the next action (or comm group) of `st`: ('progress'|'blocked'|'done', woken)."""
        if st.pc >= len(st.acts):
            return "done", ()
        a = st.acts[st.pc]
        if a.is_comm:
            return self.comm(st)
        return self.local(st, a)

    # ---- communication ----
    def _channel(self, st: _Stage, step: int, a: Action):
        s, d = st.idx, self.d
        if a.kind == RECV_ACT:
            if s == 0:
                self.fail(st, step, "stage 0 has no previous stage to receive an activation from")
            return self.act[s - 1][1], self.act[s - 1][0], s - 1, "activation"
        if a.kind == SEND_ACT:
            if s == d - 1:
                self.fail(st, step, "the last stage has no next stage to send an activation to")
            if a.mb not in st.f:
                self.fail(st, step, f"activation of microbatch {a.mb} sent before its forward")
            return self.act[s][0], self.act[s][1], s + 1, "activation"
        if a.kind == RECV_GRAD:
            if s == d - 1:
                self.fail(st, step, "the last stage has no next stage to receive a gradient from")
            return self.grad[s][1], self.grad[s][0], s + 1, "gradient"
        if s == 0:
            self.fail(st, step, "stage 0 has no previous stage to send a gradient to")
        if a.mb not in st.b:
            self.fail(st, step, f"gradient of microbatch {a.mb} sent before its backward")
        return self.grad[s - 1][0], self.grad[s - 1][1], s - 1, "gradient"

    def comm(self, st: _Stage):
        woken = ()
        if st.group is None:  # post the whole group
            group, i = [], st.pc
            while i < len(st.acts) and st.acts[i].is_comm:
                a = st.acts[i]
                if not self.sched.is_training and a.kind in (RECV_GRAD, SEND_GRAD):
                    self.fail(st, i, "a forward-only schedule has no gradients")
                if a.mb in st.posted[a.kind]:
                    self.fail(st, i, f"{a} posted twice")
                mine, other, peer, what = self._channel(st, i, a)
                post = _Post(st.idx, i, a, st.clock, st.window)
                mine.append(post)
                idx = len(mine) - 1
                if idx < len(other):
                    self._check_pair(st, post, other[idx], what)
                st.posted[a.kind].add(a.mb)
                group.append((i, a, post, other, idx, peer))
                i += 1
            st.group = group
            woken = {g[5] for g in group}
        done_at = st.clock
        per_op = callable(self.latency)
        for i, a, post, other, idx, peer in st.group:
            if idx >= len(other):
                partner = {RECV_ACT: "sa", SEND_ACT: "ra", RECV_GRAD: "sg", SEND_GRAD: "rg"}[a.kind]
                st.wait = f"{peer}{partner}{a.mb} (stage {peer} to post it)"
                st.wait_step = i
                return "blocked", woken
            ready = max(st.clock, other[idx].time)
            done_at = max(done_at, ready + float(self.latency(st.idx, a)) if per_op else ready)
        if not per_op:
            done_at += self.latency
        for i, a, post, other, idx, peer in st.group:
            st.timeline.append((post.time, done_at, a))
            if a.kind in st.recv_done:
                st.recv_done[a.kind].add(a.mb)
        st.pc = st.group[-1][0] + 1
        st.group, st.clock, st.wait = None, done_at, ""
        return "progress", woken

    def _check_pair(self, st: _Stage, post: _Post, partner: _Post, what: str):
        plabel = f"{partner.action.label(partner.stage)} (stage {partner.stage} step {partner.step})"
        if partner.action.mb != post.action.mb:
            self.fail(st, post.step, f"paired FIFO with {plabel}: microbatch {post.action.mb} "
                                     f"!= {partner.action.mb} on this {what} channel")
        if partner.window != post.window:
            self.fail(st, post.step, f"posted in window {post.window} but its partner {plabel} is "
                                     f"in window {partner.window}; send/recv pairs must not cross "
                                     f"an optimizer step")

    # ---- compute and batch actions ----
    def local(self, st: _Stage, a: Action):
        s, step, sched, m = st.idx, st.pc, self.sched, self.m
        fail = lambda msg: self.fail(st, step, msg)  # noqa: E731
        start, woken = st.clock, ()
        if a.kind in (FORWARD, BACKWARD):
            if a.mb not in self.segment:
                fail(f"microbatch {a.mb} is not in this segment "
                     f"({self.segment.start}..{self.segment.stop - 1})")
            t = a.mb // m
        if a.kind == FORWARD:
            if a.mb in st.f:
                fail(f"forward of microbatch {a.mb} runs twice")
            if s > 0 and a.mb not in st.recv_done[RECV_ACT]:
                fail(f"forward of microbatch {a.mb} before its activation was received")
            if a.version != sched.slot_of_batch(t):
                fail(f"forward of microbatch {a.mb} (batch {t}) must use slot "
                     f"{sched.slot_of_batch(t)}, not v{a.version}")
            if st.slots[a.version] != sched.weight_of_batch(t):
                fail(f"slot {a.version} holds W({st.slots[a.version]}) but batch {t} "
                     f"needs W({sched.weight_of_batch(t)})")
            st.f[a.mb] = (a.version, st.slots[a.version])
        elif a.kind == BACKWARD:
            if not sched.is_training:
                fail("a forward-only schedule has no backward")
            if a.mb in st.b:
                fail(f"backward of microbatch {a.mb} runs twice")
            if a.mb not in st.f:
                fail(f"backward before forward of microbatch {a.mb}")
            slot, weight = st.f[a.mb]
            if a.version != slot:
                fail(f"backward of microbatch {a.mb} uses v{a.version} but its forward used v{slot}")
            if s < self.d - 1 and a.mb not in st.recv_done[RECV_GRAD]:
                fail(f"backward of microbatch {a.mb} before its gradient was received")
            if st.slots[slot] != weight:
                fail(f"slot {slot} now holds W({st.slots[slot]}) but the forward of microbatch "
                     f"{a.mb} used W({weight}): a step overwrote it too early")
            g = sched.grad_buffers_of(s)
            if st.window <= t - g:  # batch t - g's step has not consumed the buffer yet
                fail(f"backward of microbatch {a.mb} (batch {t}) accumulates into gradient "
                     f"buffer {sched.grad_buffer_of_batch(t, s)} before S{t - g} consumed batch "
                     f"{t - g}'s gradient there ({g} buffer{'s' * (g != 1)} per stage)")
            st.b.add(a.mb)
            st.b_per_batch[t] = st.b_per_batch.get(t, 0) + 1
        else:
            t, kind = a.batch, a.kind
            if not sched.is_training:
                fail("a forward-only schedule has no reduction or optimizer step")
            if t != st.next[kind]:
                fail(f"{kind}{t} out of order: expected {kind}{st.next[kind]}")
            if t >= self.t0 + self.T:
                fail(f"batch {t} is not in this segment ({self.t0}..{self.t0 + self.T - 1})")
            nb = st.b_per_batch.get(t, 0)
            if kind in (REDUCE, STEP) and nb < m:
                what = "reduction" if kind == REDUCE else "optimizer step"
                fail(f"{what} of batch {t} before all its backwards ({nb} of {m} done)")
            if kind in (REDUCE, NORM) and st.window != t:
                fail(f"{kind}{t} is in window {st.window}; it must come after S{t - 1}")
            if kind == NORM and st.next[REDUCE] <= t:
                fail(f"N{t} before R{t}")
            if kind == STEP and st.next[NORM] <= t:
                fail(f"S{t} before N{t}")
            tied = self.d > 1 and s in (0, self.d - 1)
            if kind == STEP and t not in st.slots:
                fail(f"the step of batch {t} needs W({t}) but the slots hold {st.slots}")
            waits = []
            if kind == NORM and tied and s == 0:
                waits.append(("tied", self.d - 1))
            if kind == STEP:
                if tied and s == self.d - 1:
                    waits.append(("tied", 0))
                waits += [("norm", x) for x in range(self.d)]
            for coll, x in waits:
                posts = (self.tied if coll == "tied" else self.norm).get(t, {})
                if x not in posts:
                    missing = [y for c, y in waits if c == coll and
                               y not in (self.tied if c == "tied" else self.norm).get(t, {})]
                    st.wait = f"{coll}({t}) from stage{'s' if len(missing) > 1 else ''} " + \
                        ", ".join(map(str, missing))
                    return "blocked", ()
                start = max(start, posts[x])
        dur = float(self.dur(s, a))
        end = start + dur
        st.timeline.append((start, end, a))
        st.busy += dur
        st.clock, st.wait = end, ""
        st.pc += 1
        if a.kind in (REDUCE, NORM, STEP):
            st.next[a.kind] += 1
        if a.kind == REDUCE and self.d > 1 and s in (0, self.d - 1):
            self.tied.setdefault(a.batch, {})[s] = end
            woken = (0, self.d - 1)
        elif a.kind == NORM:
            self.norm.setdefault(a.batch, {})[s] = end
            woken = range(self.d)
        elif a.kind == STEP:
            st.slots[sched.step_writes_slot(a.batch)] = a.batch + 1
            st.window += 1
        return "progress", woken

    # ---- end of segment ----
    def final_checks(self):
        for st in self.stages:
            end = len(st.acts)
            for mb in self.segment:
                if mb not in st.f:
                    self.fail(st, end, f"microbatch {mb} never ran forward")
                if self.sched.is_training and mb not in st.b:
                    self.fail(st, end, f"microbatch {mb} never ran backward")
            if self.sched.is_training:
                for kind in (REDUCE, NORM, STEP):
                    if st.next[kind] != self.t0 + self.T:
                        self.fail(st, end, f"{kind}{st.next[kind]} never ran")
        for chans, what in ((self.act, "activation"), (self.grad, "gradient")):
            for sends, recvs in chans:
                if len(sends) != len(recvs):
                    p = (sends if len(sends) > len(recvs) else recvs)[min(len(sends), len(recvs))]
                    self.fail(self.stages[p.stage], p.step, f"{what} op never matched")

    def result(self) -> SimResult:
        makespan = max((st.clock for st in self.stages), default=0.0)
        bubble = [(makespan - st.busy) / makespan if makespan > 0 else 0.0 for st in self.stages]
        return SimResult(self.sched, [st.timeline for st in self.stages], makespan,
                         [st.busy for st in self.stages], bubble,
                         [self.sched.peak_in_flight(st.idx) for st in self.stages],
                         [st.slots for st in self.stages])


def simulate(schedule_or_table, durations=None, comm_latency=0.0) -> SimResult:
    """Run the schedule (a `Schedule`, or a bare table whose semantics `Schedule.from_table`
    guesses) and return its timing; raise `ScheduleError` on any violation or deadlock."""
    sched = schedule_or_table if isinstance(schedule_or_table, Schedule) \
        else Schedule.from_table(schedule_or_table)
    return _Sim(sched, durations, comm_latency).run()


def validate(schedule) -> SimResult:
    return simulate(schedule)


_VERDICTS: dict = {}  # Schedule.shape -> True or the ScheduleError


def check_schedule(schedule: Schedule) -> None:
    """Raise the validator's one-line ScheduleError if `schedule` is invalid. The verdict is
    computed once per shape (generated tables) or per object (custom tables), so the engine asks
    before every window it runs at the cost of an attribute read."""
    verdict = schedule.verdict
    if verdict is None:
        key = schedule.shape
        verdict = _VERDICTS.get(key) if key is not None else None
        if verdict is None:
            try:
                validate(schedule.materialized())
                verdict = True
            except ScheduleError as e:
                verdict = e
            if key is not None:
                _VERDICTS[key] = verdict
        schedule.verdict = verdict
    if verdict is not True:
        raise ScheduleError(f"{schedule!r} is not a valid schedule: {verdict}", verdict.grid)


GRID_DURATIONS = {FORWARD: 1.0, BACKWARD: 1.0, STEP: 1.0, REDUCE: 0.0, NORM: 0.0}


def format_grid(schedule, durations=None, comm_latency: float = 0.0) -> str:
    """One row per stage, one column per time unit of a unit-duration simulation (F=B=S=1)."""
    res = simulate(schedule, GRID_DURATIONS if durations is None else durations, comm_latency)
    return res.grid()


__all__ = ["ScheduleError", "SimResult", "simulate", "validate", "check_schedule", "format_grid",
           "DEFAULT_DURATIONS", "GRID_DURATIONS"]
