#!/usr/bin/env python
"""Draw a pipeline timeline: a simulated schedule or an engine --trace.
Code: megatron_2bw/cli/plot_schedule.py; installed: `m2bw-plot-schedule`."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the command's names, for scripts and tests that import this file as a module
from megatron_2bw.cli.plot_schedule import *  # noqa: E402,F401,F403
from megatron_2bw.cli.plot_schedule import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
