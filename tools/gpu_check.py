#!/usr/bin/env python
"""The prepared GPU check: run it once on a GPU node before the first cluster job.
Code: megatron_2bw/testing/gpu_check.py; installed: `m2bw-gpu-check`."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the command's names, for scripts and tests that import this file as a module
from megatron_2bw.testing.gpu_check import *  # noqa: E402,F401,F403
from megatron_2bw.testing.gpu_check import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
