"""Compatibility name: the DeepSpeed drop-in lives in the `megatron_2bw.deepspeed` package
(initialize / init_distributed / add_config_arguments, engine.py, views.py, checkpoint.py)."""
from .deepspeed import DeepSpeedPipelineEngine, add_config_arguments, init_distributed, initialize
from .deepspeed import _discover_env  # noqa: F401  (still imported from here)
from .deepspeed.checkpoint import STATE_KEYS  # noqa: F401

__all__ = ["DeepSpeedPipelineEngine", "add_config_arguments", "init_distributed", "initialize"]
