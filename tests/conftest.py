import os
import sys

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
sys.path.insert(0, ROOT)
# the tiers (unit/: no processes, distributed/: gloo processes, e2e/: commands and tools) share
# helpers (fault_hooks.py, fault_entry.py here; test modules import each other's builders)
for _tier in ("", "unit", "distributed", "e2e"):
    sys.path.insert(1, os.path.join(TESTS, _tier))
os.environ.setdefault("WANDB_MODE", "offline")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _restore_environment():
    """Launcher variables set by code under test (init_distributed, SLURM rendezvous) must not
    leak into later tests: restore os.environ after every test."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
