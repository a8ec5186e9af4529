#!/usr/bin/env python
"""Pretrain a GPT with the 2BW (or flush / gpipe) pipeline engine. Megatron-LM flag names.
See README.md for the commands; every bad flag or setting is reported in one line before any
process group starts. Installed: `m2bw-pretrain-gpt` (megatron_2bw/cli/pretrain_gpt.py)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_2bw.cli.pretrain_gpt import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
