"""DeepSpeed JSON -> the typed Config: the second front door (Megatron flags are the first).

    cfg, ds = config_from_deepspeed(ds_json, world_size=4, num_stages=2, num_layers=12)
    cfg, ds = merge_flags_and_ds_config(cfg_from_flags, {"--lr", ...}, "ds_config.json")

Both return a new (frozen) Config and the DeepSpeed-only `DeepSpeedSettings` (engine_settings.py:
the exact lr schedule, the pipeline section's checkpoint interval and stages, data loading).

What maps where (DeepSpeed key -> Config field, Megatron flag):

    train_batch_size                  batch.global_batch_size      --global-batch-size
    train_micro_batch_size_per_gpu    batch.micro_batch_size       --micro-batch-size
    gradient_accumulation_steps       (m: global / (micro x dp))   --global-batch-size
    optimizer {type, params}          optimizer.*                  --optimizer --lr --adam-beta1/2
                                                                   --adam-eps --weight-decay
                                                                   --sgd-momentum
    scheduler {type, params}          DeepSpeedSettings.lr_schedule (DeepSpeed's exact arithmetic,
                                      `DeepSpeedLR`) and the nearest Megatron fields
                                                                   --lr --min-lr --lr-warmup-iters
                                                                   --lr-decay-iters --lr-decay-style
    fp16 {enabled, loss_scale, initial_scale_power, loss_scale_window, hysteresis, min_loss_scale}
                                      precision.*                  --fp16 --loss-scale ...
    bf16 {enabled}                    precision.dtype              --bf16
    gradient_clipping                 optimizer.clip_grad          --clip-grad
    steps_per_print                   train.log_interval           --log-interval
    wall_clock_breakdown              train.wall_clock_breakdown   --wall-clock-breakdown
    wandb {enabled, project, team,    train.wandb_project,         --wandb-project
           group}                     _entity, _group              --wandb-entity
    pipeline {schedule, activation_checkpoint_interval, stages}
                                      schedule, model.recompute_*  --pipeline-schedule ...
    zero_optimization {stage}         1: parallel.distributed_optimizer  --use-distributed-optimizer
                                      (sharded over the replicas); 0: none; 2, 3: refused
      {reduce_bucket_size, overlap_comm}  at stage 1: parallel.grad_bucket_size,
                                      parallel.overlap_grad_reduce  --ddp-bucket-size ...

Any two of the batch triple imply the third (train_batch = micro x accumulation x data-parallel
size). Every bad setting is a one-line `ConfigError` naming the JSON key, raised before any
process group work. Every key is looked up (keys.py): DeepSpeed settings that change nothing
here (monitors, profilers, I/O) are accepted; features that would change what is trained
(curricula, autocast, sparse/quantized models, AutoTP, MoE) are refused; a key DeepSpeed ignores
(top level, "pipeline") is one warning line with the closest known key ("did you mean"), an
error under "strict": true; in the sections DeepSpeed validates (fp16, bf16, wandb) an unknown
key is an error, as in DeepSpeed.

Semantics that differ from DeepSpeed (documented, not hidden): weight decay applies to matrices
and embeddings only (DeepSpeed decays every parameter of a group); fp16 dynamic loss scaling uses
our scaler (same window/hysteresis meaning).

What the JSON states explicitly is recorded in `Config.fixed` ("train_batch_size=16 in the
DeepSpeed config"), so --auto-plan keeps it and a contradiction names it.

Modules: read.py (finding the JSON), types.py (the type of every key the drop-in reads, with
DeepSpeed's pydantic coercion where DeepSpeed coerces), keys.py (the key vocabulary), batch.py
(the batch triple),
setting.py (Setting, fail), optim.py / schedulers.py / sections.py (JSON sections -> Settings;
schedulers.py also holds `DeepSpeedLR`), engine_settings.py (`DeepSpeedSettings`), merge.py
(Settings onto a Config: both front doors).

Owns: the DeepSpeed JSON front door: reading it, its key vocabulary, the batch triple, each
section as Settings, DeepSpeed's lr schedulers and merging them onto a Config.
Must not import: parallel, pipeline, models, tensor_parallel, optim, data, checkpoint, training,
planner, deepspeed, testing, pretrain, generate.
"""
from megatron_2bw.config.ds_json.batch import batch_triple
from megatron_2bw.config.ds_json.engine_settings import DeepSpeedSettings
from megatron_2bw.config.ds_json.keys import IGNORED_KEYS, REFUSED_KEYS, SUPPORTED_KEYS
from megatron_2bw.config.ds_json.merge import (config_from_deepspeed, explicit_flags,
                                               merge_flags_and_ds_config)
from megatron_2bw.config.ds_json.read import load_ds_json
from megatron_2bw.config.ds_json.schedulers import DS_SCHEDULERS, DeepSpeedLR, deepspeed_lr
from megatron_2bw.config.ds_json.sections import ds_settings
from megatron_2bw.config.ds_json.setting import Setting

__all__ = ["DS_SCHEDULERS", "DeepSpeedLR", "DeepSpeedSettings", "IGNORED_KEYS", "REFUSED_KEYS",
           "SUPPORTED_KEYS", "Setting", "batch_triple", "config_from_deepspeed", "deepspeed_lr",
           "ds_settings", "explicit_flags", "load_ds_json", "merge_flags_and_ds_config"]
