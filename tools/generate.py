#!/usr/bin/env python
"""Sample text from a checkpoint or a HuggingFace directory. See megatron_2bw/generate.py.

Example:
  python tools/generate.py --load checkpoints/gpt --prompt "The for statement" --max-new-tokens 40
  python tools/generate.py --load hf/gpt --prompt "The for statement" --top-p 0.9 --seed 3
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_2bw.generate import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
