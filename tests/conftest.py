import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
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
