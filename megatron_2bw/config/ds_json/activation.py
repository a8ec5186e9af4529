"""The JSON's `activation_checkpointing` section, with DeepSpeed's keys and defaults.

Read by deepspeed.checkpointing.configure (and by the engine: a PipelineModule's
activation_checkpoint_interval decides what it recomputes). DeepSpeed's keys that only move the
saved activations (partition_activations, contiguous_memory_optimization, cpu_checkpointing)
are accepted and have no effect here (the caller names them in one warning line); a key
DeepSpeed does not have is left to keys.py (a did-you-mean warning, an error under "strict").
"""
from __future__ import annotations

from megatron_2bw.config.ds_json.setting import fail

ACTIVATION_DEFAULTS = {"partition_activations": False, "contiguous_memory_optimization": False,
                       "cpu_checkpointing": False, "number_checkpoints": None,
                       "synchronize_checkpoint_boundary": False, "profile": False}
ACTIVATION_KEYS = tuple(ACTIVATION_DEFAULTS)
MEMORY_ONLY_KEYS = ("partition_activations", "contiguous_memory_optimization",
                    "cpu_checkpointing")


def activation_checkpointing_settings(section: dict | None) -> dict:
    """DeepSpeed's defaults overlaid with `section`'s known keys (None or {}: the defaults)."""
    section = section or {}
    if not isinstance(section, dict):
        fail(f"DeepSpeed config: 'activation_checkpointing' must be a section, got {section!r}")
    section = {k: v for k, v in section.items() if k in ACTIVATION_KEYS}
    n = section.get("number_checkpoints")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        fail(f"DeepSpeed config: activation_checkpointing.number_checkpoints must be an integer "
             f">= 1 or null, got {n!r}")
    return {**ACTIVATION_DEFAULTS, **section}
