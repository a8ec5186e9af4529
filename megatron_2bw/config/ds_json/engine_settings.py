"""What a DeepSpeed JSON sets besides the typed Config: settings only the DeepSpeed surface has.

    cfg, ds = config_from_deepspeed(ds_json, ...)      # or merge_flags_and_ds_config(...)
    ds.lr_schedule            # DeepSpeedLR or None: the "scheduler" section, exactly
    ds.activation_checkpoint_interval, ds.stages, ds.dataloader_drop_last, ds.use_reentrant
    ds.notes                  # one warning line per unknown key DeepSpeed ignores

The core engine knows none of these: the DeepSpeed adapter (megatron_2bw/deepspeed) reads the
pipeline and data-loading ones, and whoever builds the engine passes `lr_schedule` to it
(`PipelineEngine(lr_schedule=...)`; None keeps the Megatron schedule of the Config).
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_2bw.config.ds_json.schedulers import DeepSpeedLR


@dataclass(frozen=True)
class DeepSpeedSettings:
    lr_schedule: DeepSpeedLR | None = None    # "scheduler" (WarmupLR, WarmupDecayLR, ...)
    activation_checkpoint_interval: int = 0   # pipeline.activation_checkpoint_interval
    stages: int | None = None                 # pipeline.stages ("auto": None)
    dataloader_drop_last: bool = False        # dataloader_drop_last
    use_reentrant: bool = True                # pipeline.use_reentrant (DeepSpeed's default)
    notes: tuple = ()                         # warning lines: unknown keys DeepSpeed ignores
