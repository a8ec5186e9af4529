#!/usr/bin/env python
"""Train one model with 2bw (plain, compensated), flush and gpipe; compare losses.
Code: megatron_2bw/cli/compare_convergence.py; installed: `m2bw-compare-convergence`."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the command's names, for scripts and tests that import this file as a module
from megatron_2bw.cli.compare_convergence import *  # noqa: E402,F401,F403
from megatron_2bw.cli.compare_convergence import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
