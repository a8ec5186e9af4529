"""The monitor sections (tensorboard, wandb, csv_monitor, comet) and activation_checkpointing,
checked before any process group.

The monitors write through deepspeed/monitor.py (`engine.monitor`); here: their keys (DeepSpeed
validates these sections itself, so an unknown key is a did-you-mean error), their types, and
the package each needs (tensorboard, wandb, comet_ml), named in one line if it is missing (and
for wandb if it fails to import: config/packages.py, as --wandb-project).
activation_checkpointing is DeepSpeed's dict-style section (unknown keys are ignored by
DeepSpeed: a warning line here, an error under "strict"); what it turns on is the engine's
recomputation (pipeline.activation_checkpoint_interval) and deepspeed.checkpointing.
"""
from __future__ import annotations

import importlib.util

from megatron_2bw.config.ds_json.activation import (MEMORY_ONLY_KEYS,
                                                       activation_checkpointing_settings)
from megatron_2bw.config.ds_json.setting import fail
from megatron_2bw.config.packages import wandb_problem

MONITOR_KEYS = {
    "tensorboard": ("enabled", "output_path", "job_name"),
    "csv_monitor": ("enabled", "output_path", "job_name"),
    "wandb": ("enabled", "group", "team", "project"),
    "comet": ("enabled", "samples_log_interval", "project", "workspace", "api_key",
              "experiment_name", "experiment_key", "online", "mode"),
}
PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "comet": "comet_ml"}


def _enabled(ds: dict, name: str) -> dict | None:
    section = ds.get(name)
    if section is None:
        return None
    if not isinstance(section, dict):
        fail(f"DeepSpeed config: {name!r} must be a section, got {section!r}")
    enabled = section.get("enabled", False)
    if not isinstance(enabled, bool):
        fail(f"DeepSpeed config: {name}.enabled must be true or false, got {enabled!r}")
    return section if enabled else None


def check_monitors(ds: dict, find_spec=importlib.util.find_spec) -> None:
    """One-line errors for the monitors: types, and a missing package of an enabled one."""
    for name in MONITOR_KEYS:
        section = _enabled(ds, name)
        if section is None:
            continue
        for key in ("output_path", "job_name", "project", "group", "team"):
            value = section.get(key)
            if value is not None and not isinstance(value, str):
                fail(f"DeepSpeed config: {name}.{key} must be a string, got {value!r}")
        package = PACKAGES.get(name)
        if name == "wandb" and find_spec(package) is not None:  # found: does it import?
            problem = wandb_problem("DeepSpeed config: 'wandb'",
                                    instead="disable 'wandb'")
            if problem:
                fail(problem)
        if package and find_spec(package) is None:
            fail(f"DeepSpeed config: {name!r} is enabled but the {package} package is not "
                 f"installed: pip install {package.replace('_', '-')} (or disable {name!r})")


def activation_notes(ds: dict) -> list[str]:
    """One warning line per activation_checkpointing key set that has no effect here."""
    settings = activation_checkpointing_settings(ds.get("activation_checkpointing"))
    return [f"megatron-2bw: warning: activation_checkpointing.{key} is not supported: it only "
            "moves saved activations (memory) and has no effect here"
            for key in MEMORY_ONLY_KEYS if settings.get(key)]
