"""`deepspeed.runtime.pipe`: DeepSpeed's pipeline runtime names.

Owns: schedule.py (DeepSpeed's `TrainSchedule` / `InferenceSchedule` and instruction classes as a
view of the flush and forward action tables of schedule/), topology.py (DeepSpeed's topologies and
`PipelineParallelGrid`, the grid as an `mpu`).
Must not import: data, planner, testing, pretrain, generate, checkpoint, pipeline.
"""
import importlib

_SUBMODULES = ("schedule", "topology")
# DeepSpeed's deepspeed.runtime.pipe also names the pipeline-module API
_NAMES = ("PipelineModule", "LayerSpec", "TiedLayerSpec", "ProcessTopology")


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name == "module":   # deepspeed.runtime.pipe.module: the PipelineModule's module
        return importlib.import_module("megatron_2bw.deepspeed.pipe.module")
    if name in _NAMES:
        return getattr(importlib.import_module("megatron_2bw.deepspeed.pipe"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
