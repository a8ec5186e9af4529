"""`deepspeed.runtime`: the DeepSpeed module names scripts import from `deepspeed.runtime.*`.

    from megatron_2bw.deepspeed.runtime.pipe.schedule import TrainSchedule
    from megatron_2bw.deepspeed.runtime.utils import set_random_seed

Owns: DeepSpeed's `runtime` names over the project: pipe/ (`deepspeed.runtime.pipe`: the
schedule view of our flush/forward tables, the topology and its `PipelineParallelGrid`), utils.py
(`deepspeed.runtime.utils`: set_random_seed, call_to_str, ...).
Must not import: data, planner, testing, pretrain, generate, checkpoint.
"""
import importlib

_SUBMODULES = ("pipe", "utils")


def __getattr__(name):   # deepspeed.runtime.utils.set_random_seed(...) by attribute
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
