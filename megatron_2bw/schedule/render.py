"""Text grid of a simulated schedule: one row per stage, one column per time unit.

    s0 |F0v0 F1v0 .    B0v0 F2v0 B1v0 .    B2v0 S0
    s1 |.    F0v0 B0v0 F1v0 B1v0 F2v0 B2v0 .    S0

Cells show forwards, backwards and optimizer steps; '.' is idle (or waiting); comm/R/N are not
shown. Use `simulate.format_grid(schedule)` to get the grid of a schedule.
"""
from __future__ import annotations

import math

from megatron_2bw.schedule.actions import STEP

_EPS = 1e-9


def _shown(action) -> bool:
    return action.is_compute or action.kind == STEP


def render_timeline(timeline: list, marks: dict | None = None) -> str:
    """`timeline`: per stage [(start, end, Action)]; `marks`: stage -> note appended to its row."""
    marks = marks or {}
    end = 0
    for rows in timeline:
        for start, stop, a in rows:
            if _shown(a) and stop > start:
                end = max(end, math.ceil(stop - _EPS))
    cells = [["."] * end for _ in timeline]
    width = 2
    for s, rows in enumerate(timeline):
        for start, stop, a in rows:
            if not _shown(a) or stop <= start:
                continue
            text = str(a)
            width = max(width, len(text) + 1)
            for c in range(math.floor(start + _EPS), math.ceil(stop - _EPS)):
                cells[s][c] = text
    head = max((len(f"s{s}") for s in range(len(timeline))), default=2)
    lines = []
    for s, row in enumerate(cells):
        line = f"s{s}".ljust(head) + " |" + "".join(c.ljust(width) for c in row)
        line = line.rstrip()
        if s in marks:
            line += "  " + marks[s]
        lines.append(line)
    return "\n".join(lines)
