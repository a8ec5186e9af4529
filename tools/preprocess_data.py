#!/usr/bin/env python
"""JSONL -> Megatron .bin/.idx token files.
Code: megatron_2bw/cli/preprocess_data.py; installed: `m2bw-preprocess-data`."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the command's names, for scripts and tests that import this file as a module
from megatron_2bw.cli.preprocess_data import *  # noqa: E402,F401,F403
from megatron_2bw.cli.preprocess_data import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
