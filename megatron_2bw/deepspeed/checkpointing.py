"""`deepspeed.checkpointing`: activation checkpointing calls DeepSpeed scripts make.

    import megatron_2bw.deepspeed.checkpointing as checkpointing
    checkpointing.configure(None, deepspeed_config="ds_config.json")
    y = checkpointing.checkpoint(block, x)      # recomputed in the backward

`checkpoint` is torch's (`torch.utils.checkpoint`, the generator states of the forward restored
for the recomputation, so dropout draws the same masks); `configure` reads the arguments or the
JSON's `activation_checkpointing` section (config/ds_json/sections.py names what it accepts).
DeepSpeed's memory placements of the saved inputs (partition_activations, cpu_checkpointing,
contiguous_memory_optimization) change where memory goes, not what is computed: each is named in
one warning line and has no effect. A PipelineModule's `activation_checkpoint_interval` uses the
engine's own recomputation, not this module.
"""
from __future__ import annotations

import torch.utils.checkpoint

from megatron_2bw.config import ConfigError
from megatron_2bw.deepspeed.utils import log_dist
from megatron_2bw.tensor_parallel.random import RNGTracker

_STATE = {"configured": False, "use_reentrant": True, "profile": False, "synchronize": False,
          "num_checkpoints": None}
_TRACKER = {}


def _section(deepspeed_config) -> dict | None:
    if deepspeed_config is None:
        return {}
    from megatron_2bw.config.ds_json import load_ds_json
    return load_ds_json(deepspeed_config).get("activation_checkpointing")


def configure(mpu_, deepspeed_config=None, partition_activations=None,
              contiguous_checkpointing=None, num_checkpoints=None, checkpoint_in_cpu=None,
              synchronize=None, profile=None, use_reentrant=None, warn=True):
    """Record the settings (arguments win over the JSON's section, as in DeepSpeed). An unknown
    key of the section is one warning line (an error under "strict"); so is each memory
    placement that has no effect here. `warn=False` (initialize: it printed them) keeps quiet."""
    from megatron_2bw.config.ds_json.activation import (MEMORY_ONLY_KEYS,
                                                       activation_checkpointing_settings)
    from megatron_2bw.config.ds_json.keys import check_keys
    section = _section(deepspeed_config)
    lines = check_keys({"activation_checkpointing": section or {},
                        "strict": bool((deepspeed_config or {}).get("strict", False))
                        if isinstance(deepspeed_config, dict) else False})
    settings = activation_checkpointing_settings(section)
    given = {"partition_activations": partition_activations,
             "contiguous_memory_optimization": contiguous_checkpointing,
             "cpu_checkpointing": checkpoint_in_cpu, "number_checkpoints": num_checkpoints,
             "synchronize_checkpoint_boundary": synchronize, "profile": profile}
    settings.update({k: v for k, v in given.items() if v is not None})
    lines += [f"activation checkpointing: {name} only moves saved activations (memory) and is "
              "not implemented here; it has no effect"
              for name in MEMORY_ONLY_KEYS if settings.get(name)]
    for line in lines if warn else []:
        log_dist(line.removeprefix("megatron-2bw: warning: "), ranks=[0], level=30)
    _STATE.update(configured=True, profile=bool(settings.get("profile")),
                  synchronize=bool(settings.get("synchronize_checkpoint_boundary")),
                  num_checkpoints=settings.get("number_checkpoints"))
    if use_reentrant is not None:
        _STATE["use_reentrant"] = bool(use_reentrant)


def is_configured() -> bool:
    return _STATE["configured"]


def reset() -> None:
    """Forget configure() (DeepSpeed resets its buffers between iterations; there are none)."""
    _STATE.update(configured=False, use_reentrant=True, profile=False, synchronize=False,
                  num_checkpoints=None)


def checkpoint(function, *args):
    """function(*args), its activations recomputed in the backward instead of kept."""
    return torch.utils.checkpoint.checkpoint(function, *args,
                                             use_reentrant=_STATE["use_reentrant"])


def model_parallel_cuda_manual_seed(seed: int, tp_rank: int = 0) -> RNGTracker:
    """Seed the tensor-parallel generator stream (tensor_parallel/random.py) of this process."""
    _TRACKER["tracker"] = RNGTracker(seed, tp_rank)
    return _TRACKER["tracker"]


def get_cuda_rng_tracker() -> RNGTracker:
    if "tracker" not in _TRACKER:
        raise ConfigError("get_cuda_rng_tracker: call model_parallel_cuda_manual_seed(seed) "
                          "first")
    return _TRACKER["tracker"]


__all__ = ["checkpoint", "configure", "get_cuda_rng_tracker", "is_configured",
           "model_parallel_cuda_manual_seed", "reset"]
