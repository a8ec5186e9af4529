#!/usr/bin/env python
"""Draw the README's pictures into docs/img/ (timelines, convergence, memory per stage).
Code: megatron_2bw/cli/figures.py; installed: `m2bw-make-figures`."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_2bw.cli.figures import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
