#!/usr/bin/env python
"""What a checkpoint holds and whether it is whole. See megatron_2bw/checkpoint/inspect.py.

Example:
  python tools/checkpoint_inspect.py checkpoints/gpt --tensors
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_2bw.checkpoint.inspect import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
