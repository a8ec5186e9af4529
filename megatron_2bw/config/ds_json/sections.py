"""Every Config setting a DeepSpeed JSON implies, section by section (`ds_settings`): the keys
(keys.py), ZeRO, precision, clipping, logging, wandb and the "pipeline" section;
optimizer and scheduler come from optim.py and schedulers.py."""
from __future__ import annotations

import dataclasses

from megatron_2bw.config import SCHEDULES
from megatron_2bw.config.ds_json.engine_settings import DeepSpeedSettings
from megatron_2bw.config.ds_json.keys import check_keys
from megatron_2bw.config.ds_json.monitors import activation_notes, check_monitors
from megatron_2bw.config.ds_json.optim import optimizer_settings
from megatron_2bw.config.ds_json.schedulers import scheduler_settings
from megatron_2bw.config.ds_json.setting import Setting, fail
from megatron_2bw.schedule.kinds import DEFAULT_SCHEDULE


def _precision_settings(ds: dict) -> list[Setting]:
    if (ds.get("amp") or {}).get("enabled", False):
        fail('DeepSpeed config: "amp" (NVIDIA apex) is not supported: use "fp16" or "bf16"')
    fp16 = ds.get("fp16") or {}
    bf16 = ds.get("bf16") or ds.get("bfloat16") or {}
    if fp16.get("enabled", False) and bf16.get("enabled", False):
        fail('DeepSpeed config: "fp16" and "bf16" are both enabled: enable one')
    out = []
    if bf16.get("enabled", False):
        out.append(Setting("bf16.enabled", "--bf16", "precision.dtype", "bf16"))
    if fp16.get("enabled", False):
        if fp16.get("auto_cast", False):
            fail('DeepSpeed config: fp16.auto_cast is not supported (the engine does not cast '
                 'the inputs): cast them to half in the first layer, or remove "auto_cast"')
        out.append(Setting("fp16.enabled", "--fp16", "precision.dtype", "fp16"))
        scale = fp16.get("loss_scale", 0)
        out.append(Setting("fp16.loss_scale", "--loss-scale", "precision.loss_scale",
                           None if not scale else float(scale), "loss_scale" in fp16))
        power = fp16.get("initial_scale_power", 16)
        if power > 1023:  # 2 ** power overflows a float
            fail(f"DeepSpeed config: fp16.initial_scale_power {power}: the loss scale 2^{power} "
                 "is no float; use at most 1023 (DeepSpeed's default: 16)")
        out.append(Setting("fp16.initial_scale_power", "--initial-loss-scale",
                           "precision.initial_loss_scale", float(2 ** power),
                           "initial_scale_power" in fp16))
        for key, flag, path, default in (
                ("loss_scale_window", "--loss-scale-window", "precision.loss_scale_window", 1000),
                ("hysteresis", "--hysteresis", "precision.hysteresis", 2),
                ("min_loss_scale", "--min-loss-scale", "precision.min_loss_scale", 1.0)):
            out.append(Setting(f"fp16.{key}", flag, path, fp16.get(key, default), key in fp16))
    return out


def _check_keys_and_zero(ds: dict) -> list[str]:
    """Unknown and refused keys (keys.py), ZeRO stages and features the pipeline engine cannot
    honour; returns the warning lines of ignored unknown keys."""
    notes = check_keys(ds)
    zero = ds.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        fail(f"DeepSpeed config: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    if stage >= 2:
        fail(f"DeepSpeed config: zero_optimization.stage {stage} is incompatible with pipeline "
             "parallelism (in DeepSpeed too): use stage 0 or 1")
    for off in ("offload_optimizer", "offload_param"):
        if (zero.get(off) or {}).get("device", "none") not in ("none", None):
            fail(f"DeepSpeed config: zero_optimization.{off} is not supported")
    if ds.get("gradient_predivide_factor", 1.0) != 1.0:
        fail("DeepSpeed config: gradient_predivide_factor other than 1.0 is not supported")
    return notes


def _zero_settings(ds: dict) -> list[Setting]:
    """ZeRO stage 1 (optimizer state partitioned over the data-parallel ranks) is the
    distributed optimizer: master weights and optimizer state sharded over the replicas, the
    same arithmetic (stages 2 and 3 are refused in _check_keys_and_zero)."""
    zero = ds.get("zero_optimization") or {}
    if not (isinstance(zero, dict) and zero.get("stage", 0) == 1):
        return []
    out = [Setting("zero_optimization.stage", "--use-distributed-optimizer",
                   "parallel.distributed_optimizer", True)]
    # the gradient reduce-scatter's buckets and whether they overlap the backward
    # (pipeline/grad_reduce.py), in DeepSpeed's units: elements, and a switch
    if "reduce_bucket_size" in zero:
        size = zero["reduce_bucket_size"]
        if isinstance(size, bool) or not isinstance(size, (int, float)) or size < 1 or \
                size != int(size):
            fail("DeepSpeed config: zero_optimization.reduce_bucket_size must be a positive "
                 f"number of elements, got {size!r}")
        out.append(Setting("zero_optimization.reduce_bucket_size", "--ddp-bucket-size",
                           "parallel.grad_bucket_size", int(size)))
    if "overlap_comm" in zero:
        on = bool(zero["overlap_comm"])
        out.append(Setting("zero_optimization.overlap_comm",
                           "--overlap-grad-reduce" if on else "--no-overlap-grad-reduce",
                           "parallel.overlap_grad_reduce", on))
    return out


def _logging_settings(ds: dict) -> list[Setting]:
    """gradient_clipping, steps_per_print, wall_clock_breakdown and wandb."""
    out = []
    if "gradient_clipping" in ds:
        clip = ds["gradient_clipping"]
        if not isinstance(clip, (int, float)) or clip < 0:
            fail(f"DeepSpeed config: gradient_clipping must be >= 0, got {clip!r}")
        out.append(Setting("gradient_clipping", "--clip-grad", "optimizer.clip_grad", float(clip)))
    else:
        out.append(Setting("gradient_clipping", "--clip-grad", "optimizer.clip_grad", 0.0, False,
                           absent=True))
    spp = ds.get("steps_per_print", 10)
    if not isinstance(spp, int) or spp < 1:
        fail(f"DeepSpeed config: steps_per_print must be a positive integer, got {spp!r}")
    out.append(Setting("steps_per_print", "--log-interval", "train.log_interval", spp,
                       "steps_per_print" in ds, absent="steps_per_print" not in ds))
    if "wall_clock_breakdown" in ds:
        out.append(Setting("wall_clock_breakdown", "--wall-clock-breakdown",
                           "train.wall_clock_breakdown", bool(ds["wall_clock_breakdown"])))
    wandb = ds.get("wandb") or {}
    if wandb.get("enabled", False):
        out.append(Setting("wandb.project", "--wandb-project", "train.wandb_project",
                           wandb.get("project") or "deepspeed"))
        if wandb.get("team"):  # DeepSpeed's team is wandb's entity
            out.append(Setting("wandb.team", "--wandb-entity", "train.wandb_entity",
                               wandb["team"]))
        if wandb.get("group"):  # wandb's run group (no Megatron flag)
            out.append(Setting("wandb.group", None, "train.wandb_group", wandb["group"]))
    return out


def _pipeline_settings(ds: dict) -> tuple[list[Setting], DeepSpeedSettings]:
    """The "pipeline" section: schedule, activation checkpointing, stages; and the DeepSpeed-only
    settings (with dataloader_drop_last)."""
    out = []
    pipe = ds.get("pipeline") or {}
    if not isinstance(pipe, dict):
        fail('DeepSpeed config: "pipeline" must be an object')
    schedule = pipe.get("schedule", DEFAULT_SCHEDULE)
    if schedule not in SCHEDULES:
        fail(f"DeepSpeed config: pipeline.schedule {schedule!r} is unknown: use one of "
             f"{', '.join(SCHEDULES)} (DeepSpeed's own 1F1B schedule is 'flush')")
    out.append(Setting("pipeline.schedule", "--pipeline-schedule", "schedule", schedule,
                       "schedule" in pipe, absent="schedule" not in pipe))
    interval = pipe.get("activation_checkpoint_interval", 0)
    if not isinstance(interval, int) or interval < 0:
        fail("DeepSpeed config: pipeline.activation_checkpoint_interval must be an integer >= 0")
    if interval:
        out.append(Setting("pipeline.activation_checkpoint_interval", "--recompute-granularity",
                           "model.recompute_granularity", "full"))
        out.append(Setting("pipeline.activation_checkpoint_interval", "--recompute-method",
                           "model.recompute_method", "uniform"))
        out.append(Setting("pipeline.activation_checkpoint_interval", "--recompute-num-layers",
                           "model.recompute_num_layers", interval))
    stages = pipe.get("stages", "auto")
    if stages != "auto":
        if not isinstance(stages, int) or stages < 1:
            fail(f"DeepSpeed config: pipeline.stages must be 'auto' or a positive integer, got "
                 f"{stages!r}")
        out.append(Setting("pipeline.stages", "--pipeline-model-parallel-size",
                           "parallel.pipeline", stages))
    flags = {k: pipe.get(k, True) for k in ("use_reentrant", "pipe_partitioned",
                                             "grad_partitioned")}
    for key, value in flags.items():
        if not isinstance(value, bool):
            fail(f"DeepSpeed config: pipeline.{key} must be true or false, got {value!r}")
    return out, DeepSpeedSettings(
        activation_checkpoint_interval=interval, stages=None if stages == "auto" else stages,
        dataloader_drop_last=bool(ds.get("dataloader_drop_last", False)),
        use_reentrant=flags["use_reentrant"])


def ds_settings(ds: dict, lr_hint: float = 1e-3) -> tuple[list[Setting], DeepSpeedSettings]:
    """Every Config setting the JSON implies (besides the batch triple), and the DeepSpeed-only
    settings (pipeline section, data loading; the lr schedule is added by merge.py once the
    optimizer's lr is known)."""
    if not isinstance(ds, dict):
        fail("DeepSpeed config must be a JSON object")
    notes = _check_keys_and_zero(ds)
    check_monitors(ds)
    notes += activation_notes(ds)
    out = optimizer_settings(ds)
    lr = next((s.value for s in out if s.path == "optimizer.lr"), lr_hint)
    out += scheduler_settings(ds, lr)
    out += _precision_settings(ds)
    out += _logging_settings(ds)
    out += _zero_settings(ds)
    pipeline, settings = _pipeline_settings(ds)
    return out + pipeline, dataclasses.replace(settings, notes=tuple(notes))
