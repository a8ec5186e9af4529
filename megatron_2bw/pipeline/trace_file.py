"""Reading the engine's action traces (`pretrain_gpt.py --trace FILE` writes FILE.rank<r>.json
through engine.py `save_trace`): each file read inside a one-line error (config/input_files.py)
and checked to be a trace, so tools/plot_schedule.py --trace (and tools/gpu_check.py) never
fails with a traceback on a file that is not one.

    read_traces(files, fix)   [trace dict per file]; SystemExit with one line otherwise (the
                              tool's errors end it with their line)

A trace is {"rank": int, "events": [[actions, start, end], ...], ...}: `actions` the
space-separated printable actions of one group (schedule/actions.py, e.g. "F3v0 sa3"), start
and end in seconds.
"""
from __future__ import annotations

from megatron_2bw.config.input_files import read_json
from megatron_2bw.config.numbers import is_finite
from megatron_2bw.schedule import actions as A


def _event_ok(e) -> bool:
    if not (isinstance(e, list) and len(e) >= 3 and isinstance(e[0], str)
            and is_finite(e[1]) and is_finite(e[2])):
        return False
    try:
        [A.parse(x) for x in e[0].split()]
    except ValueError:
        return False
    return True


def read_traces(files: list[str], fix: str) -> list[dict]:
    traces = [read_json(f, fix, dict, SystemExit) for f in files]
    for f, t in zip(files, traces):
        events = t.get("events", [])
        if not isinstance(t.get("rank", 0), int) or not isinstance(events, list) or \
                not all(map(_event_ok, events)):
            raise SystemExit(f"{f}: not an engine trace (\"events\" must be a list of "
                             f"[actions, start, end] such as [\"F0v0\", 0.5, 0.7]); {fix}")
    return traces
