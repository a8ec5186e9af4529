#!/usr/bin/env python
"""Prove a parallel layout reproduces single-process training. See megatron_2bw/testing/verify.py.

Example:
  python tools/verify_equivalence.py --schedule 2bw --pipeline-model-parallel-size 2 \
      --data-parallel-size 2 --num-layers 4 --hidden-size 64 --num-attention-heads 4 \
      --seq-length 32 --micro-batch-size 2 --global-batch-size 16 --train-iters 6
  python tools/verify_equivalence.py --schedule 2bw --2bw-compensation predict-spike \
      --pipeline-model-parallel-size 2 --num-layers 4 --hidden-size 64 --num-attention-heads 4 \
      --seq-length 16 --micro-batch-size 2 --global-batch-size 8 --train-iters 5
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_2bw.testing.verify import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
