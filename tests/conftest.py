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


@pytest.fixture(autouse=True)
def _no_process_group_left_behind(request):
    """A test that starts a default process group in the test process must end it: one left
    behind fails every later test of that worker that checks nothing started (or starts its own).
    The leaking test fails here, by name, and the group is ended so later tests run clean."""
    yield
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    dist.destroy_process_group()
    pytest.fail(f"{request.node.nodeid} left a default process group initialized: end it "
                "(torch.distributed.destroy_process_group) in the test's teardown")


_TIER_ORDER = {"e2e": 0, "distributed": 1, "unit": 2}


def pytest_collection_modifyitems(config, items):
    """Run the tiers slowest first (e2e, distributed, unit), each file's tests in their own order:
    with two workers (pytest.ini) the many short unit files fill the end instead of one long
    e2e file running alone."""
    def tier(item):
        parts = os.path.relpath(str(item.fspath), TESTS).split(os.sep)
        return _TIER_ORDER.get(parts[0], 3) if len(parts) > 1 else 3
    items.sort(key=tier)  # stable: the order within a tier is collection order
