"""tests/unit runs no processes: a unit test that starts a Python process (multiprocessing,
torch.multiprocessing, a subprocess of python or torchrun) fails here and belongs in
tests/distributed (gloo processes) or tests/e2e (commands). A C compiler run (the native
kernel's build) is not a process of the package and is allowed."""
import multiprocessing.process
import os
import subprocess

import pytest

_PYTHONS = ("python", "torchrun", "deepspeed", "pytest")


def _is_python(argv) -> bool:
    if isinstance(argv, (str, bytes, os.PathLike)):
        argv = [os.fsdecode(argv).split()[0]] if os.fsdecode(argv).split() else [""]
    first = os.path.basename(os.fsdecode(argv[0])) if argv else ""
    return first.startswith(_PYTHONS) or first.endswith(".py")


@pytest.fixture(autouse=True)
def _no_processes(monkeypatch):
    popen_init = subprocess.Popen.__init__

    def guarded_popen(self, args, *a, **kw):
        if _is_python(args):
            raise AssertionError(f"a unit test started a process ({args!r}): move it to "
                                 "tests/distributed or tests/e2e")
        popen_init(self, args, *a, **kw)

    def guarded_start(self):
        raise AssertionError(f"a unit test started a process ({self!r}): move it to "
                             "tests/distributed or tests/e2e")

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded_popen)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", guarded_start)
