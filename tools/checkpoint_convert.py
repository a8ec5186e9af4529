#!/usr/bin/env python
"""Checkpoints <-> HuggingFace model directories, torch -> torch_dist, ours -> megatron-core. See
megatron_2bw/checkpoint/convert/cli.py.

Example:
  python tools/checkpoint_convert.py export --load checkpoints/gpt --save hf/gpt
  python tools/checkpoint_convert.py import --load hf/llama --save checkpoints/llama \
      --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
  python tools/checkpoint_convert.py to-megatron --load checkpoints/gpt --save megatron/gpt
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_2bw.checkpoint.convert.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
