#!/usr/bin/env python
"""Choose a parallel layout (schedule, t, d, w, micro batch, recomputation, rank order) for a model
on a machine; see `megatron_2bw/planner/cli.py` or `--help`.

    python tools/plan.py --model gpt-2.7b --num-nodes 8 --gpus-per-node 8 --gpu-memory-gb 80 \
        --global-batch-size 512 --bf16 [--json]
    python tools/plan.py --model debug --profile-out cpu.json
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_2bw.planner.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
