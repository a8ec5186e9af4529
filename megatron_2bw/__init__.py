"""megatron_2bw: Megatron-style pretraining on a PipeDream-2BW pipeline engine.

Also a DeepSpeed drop-in for pipeline models (`import megatron_2bw as deepspeed`):
`deepspeed.initialize`, `deepspeed.init_distributed`, `deepspeed.add_config_arguments`,
`deepspeed.pipe.PipelineModule / LayerSpec / TiedLayerSpec`, `deepspeed.utils.RepeatingLoader`,
`deepspeed.runtime`, `deepspeed.accelerator`, `deepspeed.checkpointing`, `deepspeed.comm` and
`deepspeed.__version__` (the DeepSpeed version whose API the drop-in follows). A script with
`from deepspeed.x import y` lines imports `megatron_2bw.deepspeed.alias as deepspeed` instead
(deepspeed/alias.py). Everything is imported lazily, on first use, so `import megatron_2bw`
stays light.

The package root holds only entry points (pretrain.py, generate.py), fs.py (every write of the
product) and pipe.py (DeepSpeed's `deepspeed.pipe` name); each concern is a package below it.
docs/ARCHITECTURE.md draws them; each package's docstring says what it owns and what it must
not import.
"""
import importlib

_LAZY = {"initialize": "deepspeed", "init_distributed": "deepspeed",
         "add_config_arguments": "deepspeed", "DeepSpeedPipelineEngine": "deepspeed",
         "PipelineModule": "pipe", "LayerSpec": "pipe", "TiedLayerSpec": "pipe"}
# DeepSpeed's module names (deepspeed.pipe, deepspeed.utils) -> where they live here
_SUBMODULES = {"pipe": "pipe", "utils": "deepspeed.utils", "deepspeed": "deepspeed",
               "runtime": "deepspeed.runtime", "accelerator": "deepspeed.accelerator",
               "checkpointing": "deepspeed.checkpointing", "comm": "deepspeed.comm"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    if name in _SUBMODULES:
        return importlib.import_module(f".{_SUBMODULES[name]}", __name__)
    if name == "__version__":
        return importlib.import_module(f"{__name__}.deepspeed.names").DEEPSPEED_API_VERSION
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
