#!/usr/bin/env python
"""Test-only entry point: pretrain_gpt.py with an injected fault, for tests that need a real
launcher (torchrun) or a real process. Usage:

    python tests/fault_entry.py [--inject KIND:RANK:ITERATION | --slow-iterations SECONDS |
                                 --slow-start SECONDS] <pretrain_gpt.py flags>

Tests may read their own argv; production code reads no fault-injection setting."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

from fault_hooks import InjectedFault, SlowIterations, SlowStart  # noqa: E402

from megatron_2bw.pipeline.faults import NO_FAULTS  # noqa: E402
from megatron_2bw.pretrain import main  # noqa: E402

if __name__ == "__main__":
    argv, hooks = sys.argv[1:], NO_FAULTS
    if argv[:1] == ["--inject"]:
        hooks, argv = InjectedFault.parse(argv[1]), argv[2:]
    elif argv[:1] == ["--slow-iterations"]:
        hooks, argv = SlowIterations(float(argv[1])), argv[2:]
    elif argv[:1] == ["--slow-start"]:
        hooks, argv = SlowStart(float(argv[1])), argv[2:]
    sys.exit(main("gpt", argv, hooks=hooks))
