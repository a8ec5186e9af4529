"""CPU runs keep freed heap memory (pipeline/host_memory.py): a stash that grows and shrinks
every batch must not page-fault its memory in again each time (GPipe on CPU did, ~6,000 faults
per batch), and MEGATRON_2BW_KEEP_FREED_MEMORY=0 restores glibc's default behaviour."""
import os
import platform
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Each "batch" stashes 24 activations of 1 MiB and frees them, as GPipe does on a stage.
SCRIPT = """
import resource, torch
from megatron_2bw.pipeline.host_memory import keep_freed_memory
on = keep_freed_memory()
def batch():
    stash = [torch.ones(1 << 18) for _ in range(24)]
    del stash
batch(); batch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    batch()
print(on, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
"""

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                           reason="glibc only")


def _faults(flag: str):
    env = dict(os.environ, MEGATRON_2BW_KEEP_FREED_MEMORY=flag, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    return out[0] == "True", float(out[1])


@glibc
def test_stash_memory_is_reused_without_page_faults():
    on, faults = _faults("1")
    assert on
    assert faults < 200, faults  # 24 MiB per batch would be ~6,000 faults if handed back


def test_opt_out_leaves_the_allocator_alone():
    on, _ = _faults("0")  # glibc's own behaviour varies (~5,600 faults per batch, sometimes ~50)
    assert not on


def test_engine_on_cpu_turns_it_on():
    import megatron_2bw.pipeline.engine as engine
    assert engine.keep_freed_memory.__module__ == "megatron_2bw.pipeline.host_memory"
