"""The simulator's time per batch against the engine's, d=2 on 2 gloo processes, CPU profile
measured by the planner itself: bench/plan_accuracy.py with its defaults (every schedule, 3
interleaved rounds of profile + engine, medians).

The README states the claim this test holds: the prediction is below the engine's measured time
per batch by 8-11% on the idle machine (the model leaves out per-forward Python work and gloo's
small all-reduces, so it errs fast), and the issue's target is 15%. So every schedule's median
predicted/measured must lie in [0.85, 1.0]. Slow, and meant for an idle machine: other processes
on the two cores slow the engine more than the profile and push the ratio down. So it runs
only when pytest runs it alone (`-n 0`, one process: the default two xdist workers would run
another test beside it) and is skipped with that command otherwise."""
import os
import sys

import pytest

from megatron_2bw.schedule.kinds import schedule_names

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOW, HIGH = 0.85, 1.0


@pytest.mark.slow
@pytest.mark.skipif(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1,
                    reason="times the engine: needs the machine to itself; run it alone: "
                           "python -m pytest -n 0 -m slow "
                           "tests/distributed/test_planner_accuracy.py")
def test_predicted_time_per_batch_tracks_the_engine():
    sys.path.insert(0, os.path.join(ROOT, "bench"))  # spawned workers import it by name
    import plan_accuracy as bench
    rows = bench.run(schedule_names(), repeats=3, log=lambda line: None)
    assert [r["schedule"] for r in rows] == list(schedule_names())
    for row in rows:
        assert LOW <= row["ratio"] <= HIGH, row
