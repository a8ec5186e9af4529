"""Timing the engine's actions for --wall-clock-breakdown and --trace without host syncs.

    clock = ActionClock(device)
    token = clock.start()                  # before an action (or a group of p2p actions)
    clock.stop(token, "forward", actions)  # after it: a breakdown key, the actions (trace labels)
    dict(clock)                            # {key: seconds} since clear(); reading resolves
    clock.events()                         # [(label, start_s, end_s)] while tracing

On the CPU start/stop read `time.time()`. On CUDA they record a pair of
`torch.cuda.Event(enable_timing=True)` on the current stream and return at once; nothing waits
for them until the totals or the events are read (once per log interval, and when the trace is
written), which waits for the newest event only. Times are seconds since the epoch on every
device: a CUDA event's time is its `elapsed_time` from an anchor event recorded, right after one
synchronize, at a known `time.time()`, so the traces of different ranks line up as before.
Resolved events go back to a pool, so a long run creates no events after its first intervals;
past PENDING_LIMIT recorded intervals the completed ones are read without waiting (`query()`), so
a run with --trace alone holds a bounded number of events too.

The clock is a read-only mapping of breakdown key -> seconds (the engine's `timers`), with
`clear()` to start a new interval. Trace labels are the printable actions joined by spaces, made
when the events are resolved, not per action.
"""
from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Callable

import torch

PENDING_LIMIT = 1024  # recorded intervals kept before completed ones are read without waiting


class ActionClock(Mapping):
    def __init__(self, device, make_event: Callable | None = None):
        """make_event() -> an object with record(), synchronize() and elapsed_time(other)
        (torch.cuda.Event's interface) for devices timed by events; default: CUDA events on a
        CUDA device, the host clock elsewhere."""
        self.device = torch.device(device)
        if make_event is None and self.device.type == "cuda":
            make_event = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
        self._make_event = make_event
        self._totals: dict[str, float] = {}
        self._pending: list[tuple] = []    # (key, actions or None, start event, end event)
        self._pool: list = []
        self._anchor = None                # (event, time.time() when it ran)
        self._events: list | None = None   # [(label, start, end)] while tracing

    # -- recording ------------------------------------------------------------------------------
    @property
    def tracing(self) -> bool:
        return self._events is not None

    def trace(self) -> None:
        """Record every action's (label, start, end) from now on."""
        self._resolve()
        self._events = []

    def start(self):
        if self._make_event is None:
            return time.time()
        if self._anchor is None:
            self._set_anchor()
        event = self._event()
        event.record()
        return event

    def stop(self, token, key: str, actions) -> None:
        """End the interval `token` began: add it to `key` and, when tracing, to the trace."""
        label = actions if self.tracing else None
        if self._make_event is None:
            self._add(key, label, token, time.time() - token)
            return
        event = self._event()
        event.record()
        self._pending.append((key, label, token, event))
        if len(self._pending) >= PENDING_LIMIT:
            self._drain()  # keep the events bounded without waiting (a trace-only run)

    # -- reading --------------------------------------------------------------------------------
    def __getitem__(self, key: str) -> float:
        self._resolve()
        return self._totals[key]

    def __iter__(self):
        self._resolve()
        return iter(dict(self._totals))

    def __len__(self) -> int:
        self._resolve()
        return len(self._totals)

    def clear(self) -> None:
        """Start a new breakdown interval (the trace keeps its events)."""
        self._resolve()
        self._totals.clear()

    def events(self) -> list | None:
        """[(label, start_s, end_s)] recorded since trace(), or None when not tracing."""
        self._resolve()
        return self._events

    # -- internals ------------------------------------------------------------------------------
    def _event(self):
        return self._pool.pop() if self._pool else self._make_event()

    def _set_anchor(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # once per run: the wall-clock reference
        event = self._make_event()
        event.record()
        event.synchronize()
        self._anchor = (event, time.time())

    def _add(self, key: str, actions, start: float, seconds: float) -> None:
        self._totals[key] = self._totals.get(key, 0.0) + seconds
        if actions is not None and self._events is not None:
            self._events.append((" ".join(str(a) for a in actions), start, start + seconds))

    def _resolve(self) -> None:
        if self._pending:
            self._pending[-1][3].synchronize()  # events complete in stream order: newest last
            self._drain()

    def _drain(self) -> None:
        """Account for the pending intervals whose end event has completed (no waiting)."""
        anchor, wall = self._anchor
        done = 0
        for key, actions, begin, end in self._pending:
            if not end.query():
                break
            self._add(key, actions, wall + anchor.elapsed_time(begin) / 1e3,
                      begin.elapsed_time(end) / 1e3)
            self._pool += (begin, end)
            done += 1
        del self._pending[:done]
