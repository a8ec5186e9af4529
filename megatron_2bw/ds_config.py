"""DeepSpeed JSON -> the typed Config: the second front door (Megatron flags are the first).

    cfg, extras = config_from_deepspeed(ds_json, world_size=4, num_stages=2, num_layers=12)
    cfg = merge_flags_and_ds_config(cfg_from_flags, {"--lr", ...}, "ds_config.json")

What maps where (DeepSpeed key -> Config field, Megatron flag):

    train_batch_size                  batch.global_batch_size      --global-batch-size
    train_micro_batch_size_per_gpu    batch.micro_batch_size       --micro-batch-size
    gradient_accumulation_steps       (m: global / (micro x dp))   --global-batch-size
    optimizer {type, params}          optimizer.*                  --optimizer --lr --adam-beta1/2
                                                                   --adam-eps --weight-decay
                                                                   --sgd-momentum
    scheduler {type, params}          optimizer.ds_scheduler (DeepSpeed's exact arithmetic, see
                                      `deepspeed_lr`) and the nearest Megatron fields
                                                                   --lr --min-lr --lr-warmup-iters
                                                                   --lr-decay-iters --lr-decay-style
    fp16 {enabled, loss_scale, initial_scale_power, loss_scale_window, hysteresis, min_loss_scale}
                                      precision.*                  --fp16 --loss-scale ...
    bf16 {enabled}                    precision.dtype              --bf16
    gradient_clipping                 optimizer.clip_grad          --clip-grad
    steps_per_print                   train.log_interval           --log-interval
    wall_clock_breakdown              train.wall_clock_breakdown   --wall-clock-breakdown
    wandb {enabled, project, group}   train.wandb_project/_exp_name  --wandb-project ...
    pipeline {schedule, activation_checkpoint_interval, stages}
                                      schedule, model.recompute_*  --pipeline-schedule ...
    zero_optimization {stage}         stage 0/1 accepted (no sharding), >= 2 is an error

Any two of the batch triple imply the third (train_batch = micro x accumulation x data-parallel
size). Every bad setting is a one-line `ConfigError` naming the JSON key, raised before any
process group work. Keys DeepSpeed has and we do not use are ignored (DeepSpeed ignores unknown
keys too), except near-misses of the keys above, which are reported as typos.

Semantics that differ from DeepSpeed (documented, not hidden): weight decay applies to matrices
and embeddings only (DeepSpeed decays every parameter of a group); ZeRO-1 does not shard the
optimizer state; fp16 dynamic loss scaling uses our scaler (same window/hysteresis meaning).
"""
from __future__ import annotations

import difflib
import json
import math
import os
from dataclasses import dataclass

from .config import SCHEDULES, Config, ConfigError

DS_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
SUPPORTED_KEYS = (
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "optimizer", "scheduler", "fp16", "bf16", "bfloat16", "gradient_clipping", "steps_per_print",
    "wall_clock_breakdown", "wandb", "pipeline", "zero_optimization", "amp",
    "dataloader_drop_last", "prescale_gradients", "gradient_predivide_factor")
_SCHED_PARAMS = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000,
                 "warmup_type": "log", "last_batch_iteration": -1},
    "WarmupDecayLR": {"total_num_steps": None, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
                      "warmup_num_steps": 1000, "warmup_type": "log", "last_batch_iteration": -1},
    "WarmupCosineLR": {"total_num_steps": None, "warmup_min_ratio": 0.0,
                       "warmup_num_steps": 1000, "cos_min_ratio": 0.0001, "warmup_type": "log",
                       "last_batch_iteration": -1},
}
_ADAM_IGNORED = ("torch_adam", "adam_w_mode", "foreach", "fused", "fp32_optimizer_states",
                 "capturable", "differentiable", "set_grad_none")


def _fail(msg: str):
    raise ConfigError(msg)


# -- reading ----------------------------------------------------------------------------------------
def load_ds_json(config=None, args=None, config_params=None) -> dict:
    """The DeepSpeed config as a dict, from `config` (dict or JSON path), `config_params` (dict)
    or `args.deepspeed_config` (path), the way deepspeed.initialize finds it."""
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if from_args is None and args is not None:
        from_args = getattr(args, "deepscale_config", None)
    given = [c for c in (config, config_params) if c is not None]
    if from_args is not None and given:
        _fail("DeepSpeed config given twice (args.deepspeed_config and the config argument of "
              "initialize): pass only one")
    if len(given) == 2 and given[0] is not given[1]:
        _fail("pass the DeepSpeed config as config= or config_params=, not both")
    source = given[0] if given else from_args
    if source is None:
        _fail("no DeepSpeed config: pass config=<dict or json path> to initialize (or "
              "args.deepspeed_config)")
    if isinstance(source, dict):
        return dict(source)
    if isinstance(source, (str, os.PathLike)):
        if not os.path.isfile(source):
            _fail(f"DeepSpeed config file {str(source)!r} does not exist")
        with open(source) as f:
            text = f.read()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            try:
                import hjson  # DeepSpeed reads configs with hjson (comments, trailing commas)
                data = hjson.loads(text)
            except Exception:  # noqa: BLE001 - report the JSON error, one line
                _fail(f"DeepSpeed config {str(source)!r} is not valid JSON: {e}")
        if not isinstance(data, dict):
            _fail(f"DeepSpeed config {str(source)!r} must hold a JSON object")
        return dict(data)
    _fail(f"DeepSpeed config must be a dict or a path, got {type(source).__name__}")


# -- the batch triple -------------------------------------------------------------------------------
def batch_triple(ds: dict, dp: int, micro=None, train_batch=None) -> tuple[int, int, int]:
    """(micro, accumulation steps, train batch) from any two of DeepSpeed's three keys (DeepSpeed's
    rules: one of train_batch/micro alone means one accumulation step). `micro`/`train_batch`
    fill keys the JSON leaves out (Megatron flags)."""
    tb = ds.get("train_batch_size", train_batch)
    mb = ds.get("train_micro_batch_size_per_gpu", micro)
    gas = ds.get("gradient_accumulation_steps")
    for key, v in (("train_batch_size", tb), ("train_micro_batch_size_per_gpu", mb),
                   ("gradient_accumulation_steps", gas)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            _fail(f"DeepSpeed config: {key} must be a positive integer, got {v!r}")
    if tb is not None and mb is not None and gas is not None:
        if tb != mb * gas * dp:
            _fail(f"DeepSpeed config: train_batch_size {tb} != train_micro_batch_size_per_gpu "
                  f"{mb} x gradient_accumulation_steps {gas} x data-parallel size {dp} = "
                  f"{mb * gas * dp}: fix one of them (any two imply the third)")
    elif tb is not None and mb is not None:
        if tb % (mb * dp):
            _fail(f"DeepSpeed config: train_batch_size {tb} is not divisible by "
                  f"train_micro_batch_size_per_gpu {mb} x data-parallel size {dp}")
        gas = tb // (mb * dp)
    elif tb is not None and gas is not None:
        if tb % (gas * dp):
            _fail(f"DeepSpeed config: train_batch_size {tb} is not divisible by "
                  f"gradient_accumulation_steps {gas} x data-parallel size {dp}")
        mb = tb // (gas * dp)
    elif mb is not None and gas is not None:
        tb = mb * gas * dp
    elif tb is not None:
        if tb % dp:
            _fail(f"DeepSpeed config: train_batch_size {tb} is not divisible by the "
                  f"data-parallel size {dp}")
        gas, mb = 1, tb // dp
    elif mb is not None:
        gas, tb = 1, mb * dp
    else:
        _fail("DeepSpeed config: set train_batch_size or train_micro_batch_size_per_gpu (any "
              "two of train_batch_size, train_micro_batch_size_per_gpu and "
              "gradient_accumulation_steps)")
    return mb, gas, tb


# -- settings: (json key, megatron flag, config path, value, given explicitly in the JSON) ----------
@dataclass
class Setting:
    key: str
    flag: str | None
    path: str
    value: object
    explicit: bool = True     # the JSON states it (else: a DeepSpeed default the JSON implies)
    absent: bool = False      # DeepSpeed's default for a key the JSON leaves out: the merge with
                              # Megatron flags ignores it (flags and their defaults stand)


def _optimizer_settings(ds: dict) -> list[Setting]:
    opt = ds.get("optimizer")
    if opt is None:
        return []
    if not isinstance(opt, dict) or "type" not in opt:
        _fail('DeepSpeed config: "optimizer" needs a "type" (Adam, AdamW or SGD) and "params"')
    kind, params = str(opt["type"]), dict(opt.get("params") or {})
    if "max_grad_norm" in params:
        _fail("DeepSpeed config: 'max_grad_norm' is not an optimizer parameter: use the "
              "top-level 'gradient_clipping'")
    out = []

    def take(name, path, flag, default):
        explicit = name in params
        value = params.pop(name, default)
        out.append(Setting(f"optimizer.params.{name}", flag, path, value, explicit))
        return value

    if kind.lower() in ("adam", "adamw"):
        w_mode = kind.lower() == "adamw" or params.get("adam_w_mode", True)
        torch_adam = params.get("torch_adam", False)
        out.append(Setting("optimizer.type", "--optimizer", "optimizer.name", "adam"))
        take("lr", "optimizer.lr", "--lr", 1e-3)
        betas = params.pop("betas", None)
        b = list(betas) if betas is not None else [0.9, 0.999]
        if len(b) != 2:
            _fail(f"DeepSpeed config: optimizer.params.betas must hold two numbers, got {betas}")
        out.append(Setting("optimizer.params.betas", "--adam-beta1", "optimizer.adam_beta1",
                           float(b[0]), betas is not None))
        out.append(Setting("optimizer.params.betas", "--adam-beta2", "optimizer.adam_beta2",
                           float(b[1]), betas is not None))
        take("eps", "optimizer.adam_eps", "--adam-eps", 1e-8)
        # FusedAdam (DeepSpeed's default) decays 0 by default; torch.optim.AdamW 0.01
        wd = take("weight_decay", "optimizer.weight_decay", "--weight-decay",
                  0.01 if torch_adam and w_mode else 0.0)
        if not w_mode and wd:
            _fail("DeepSpeed config: Adam with adam_w_mode false (L2 weight decay) is not "
                  "supported: use AdamW-style decay (adam_w_mode true) or weight_decay 0")
        if not params.pop("bias_correction", True) or params.pop("amsgrad", False):
            _fail("DeepSpeed config: bias_correction false / amsgrad true are not supported")
        for k in _ADAM_IGNORED:
            params.pop(k, None)
    elif kind.lower() == "sgd":
        out.append(Setting("optimizer.type", "--optimizer", "optimizer.name", "sgd"))
        take("lr", "optimizer.lr", "--lr", 1e-3)
        take("momentum", "optimizer.sgd_momentum", "--sgd-momentum", 0.0)
        take("weight_decay", "optimizer.weight_decay", "--weight-decay", 0.0)
        if params.pop("nesterov", False) or params.pop("dampening", 0):
            _fail("DeepSpeed config: SGD nesterov / dampening are not supported")
        for k in ("foreach", "maximize", "differentiable", "fused"):
            params.pop(k, None)
    else:
        _fail(f"DeepSpeed config: optimizer type {kind!r} is not supported: use Adam, AdamW or "
              "SGD")
    if params:
        _fail(f"DeepSpeed config: unknown optimizer.params key {sorted(params)[0]!r} for {kind}")
    return out


def _scheduler_settings(ds: dict, lr: float) -> list[Setting]:
    sch = ds.get("scheduler")
    if sch is None:
        return []
    kind = sch.get("type") if isinstance(sch, dict) else None
    if kind not in DS_SCHEDULERS:
        _fail(f"DeepSpeed config: scheduler type {kind!r} is not supported: use one of "
              f"{', '.join(DS_SCHEDULERS)}")
    given = dict(sch.get("params") or {})
    defaults = _SCHED_PARAMS[kind]
    for k in given:
        if k not in defaults:
            _fail(f"DeepSpeed config: unknown scheduler.params key {k!r} for {kind}")
    p = {**defaults, **given}
    steps = p["warmup_num_steps"]
    if not isinstance(steps, int) or isinstance(steps, bool) or steps <= 0:
        _fail(f"DeepSpeed config: scheduler.params.warmup_num_steps must be a positive integer, "
              f"got {steps!r}")
    if p["warmup_type"] not in ("log", "linear"):
        _fail(f"DeepSpeed config: scheduler.params.warmup_type must be 'log' or 'linear', got "
              f"{p['warmup_type']!r}")
    if "total_num_steps" in defaults and (not isinstance(p["total_num_steps"], int)
                                          or p["total_num_steps"] < 1):
        _fail(f"DeepSpeed config: {kind} needs scheduler.params.total_num_steps (a positive "
              "integer)")
    if p["last_batch_iteration"] != -1:
        _fail("DeepSpeed config: scheduler.params.last_batch_iteration other than -1 is not "
              "supported: resume from a checkpoint instead")
    key = f"scheduler ({kind})"
    out = [Setting(key, None, "optimizer.ds_scheduler", {"type": kind, "params": p})]
    out.append(Setting("scheduler.params.warmup_num_steps", "--lr-warmup-iters",
                       "optimizer.lr_warmup_iters", steps, "warmup_num_steps" in given))
    if kind == "WarmupLR":
        if p["warmup_max_lr"] is not None:
            out.append(Setting("scheduler.params.warmup_max_lr", "--lr", "optimizer.lr",
                               float(p["warmup_max_lr"]), "warmup_max_lr" in given))
        out.append(Setting("scheduler.params.warmup_min_lr", "--min-lr", "optimizer.min_lr",
                           float(p["warmup_min_lr"]), "warmup_min_lr" in given))
        out.append(Setting(key, "--lr-decay-style", "optimizer.lr_decay_style", "constant"))
    elif kind == "WarmupDecayLR":
        out.append(Setting("scheduler.params.warmup_max_lr", "--lr", "optimizer.lr",
                           float(p["warmup_max_lr"]), "warmup_max_lr" in given))
        out.append(Setting("scheduler.params.warmup_min_lr", "--min-lr", "optimizer.min_lr",
                           float(p["warmup_min_lr"]), "warmup_min_lr" in given))
        out.append(Setting(key, "--lr-decay-style", "optimizer.lr_decay_style", "linear"))
        out.append(Setting("scheduler.params.total_num_steps", "--lr-decay-iters",
                           "optimizer.lr_decay_iters", p["total_num_steps"]))
    else:
        out.append(Setting(key, "--lr-decay-style", "optimizer.lr_decay_style", "cosine"))
        out.append(Setting("scheduler.params.total_num_steps", "--lr-decay-iters",
                           "optimizer.lr_decay_iters", p["total_num_steps"]))
        out.append(Setting("scheduler.params.cos_min_ratio", "--min-lr", "optimizer.min_lr",
                           lr * float(p["cos_min_ratio"]), "cos_min_ratio" in given))
    return out


def _precision_settings(ds: dict) -> list[Setting]:
    if ds.get("amp", {}).get("enabled", False):
        _fail('DeepSpeed config: "amp" (NVIDIA apex) is not supported: use "fp16" or "bf16"')
    fp16 = ds.get("fp16") or {}
    bf16 = ds.get("bf16") or ds.get("bfloat16") or {}
    if fp16.get("enabled", False) and bf16.get("enabled", False):
        _fail('DeepSpeed config: "fp16" and "bf16" are both enabled: enable one')
    out = []
    if bf16.get("enabled", False):
        out.append(Setting("bf16.enabled", "--bf16", "precision.dtype", "bf16"))
    if fp16.get("enabled", False):
        out.append(Setting("fp16.enabled", "--fp16", "precision.dtype", "fp16"))
        scale = fp16.get("loss_scale", 0)
        out.append(Setting("fp16.loss_scale", "--loss-scale", "precision.loss_scale",
                           None if not scale else float(scale), "loss_scale" in fp16))
        power = fp16.get("initial_scale_power", 16)
        out.append(Setting("fp16.initial_scale_power", "--initial-loss-scale",
                           "precision.initial_loss_scale", float(2 ** power),
                           "initial_scale_power" in fp16))
        for key, flag, path, default in (
                ("loss_scale_window", "--loss-scale-window", "precision.loss_scale_window", 1000),
                ("hysteresis", "--hysteresis", "precision.hysteresis", 2),
                ("min_loss_scale", "--min-loss-scale", "precision.min_loss_scale", 1.0)):
            out.append(Setting(f"fp16.{key}", flag, path, fp16.get(key, default), key in fp16))
    return out


def ds_settings(ds: dict, lr_hint: float = 1e-3) -> tuple[list[Setting], dict]:
    """Every Config setting the JSON implies (besides the batch triple), and the extras the
    DeepSpeed engine needs that are not training semantics (pipeline section, data loading)."""
    if not isinstance(ds, dict):
        _fail("DeepSpeed config must be a JSON object")
    for key in ds:
        if key not in SUPPORTED_KEYS:
            close = difflib.get_close_matches(key, SUPPORTED_KEYS, n=1, cutoff=0.85)
            if close:
                _fail(f"unknown DeepSpeed config key {key!r} (did you mean {close[0]!r}?)")
    zero = ds.get("zero_optimization") or {}
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    if stage >= 2:
        _fail(f"DeepSpeed config: zero_optimization.stage {stage} is incompatible with pipeline "
              "parallelism (in DeepSpeed too): use stage 0 or 1")
    for off in ("offload_optimizer", "offload_param"):
        if (zero.get(off) or {}).get("device", "none") not in ("none", None):
            _fail(f"DeepSpeed config: zero_optimization.{off} is not supported")
    if ds.get("gradient_predivide_factor", 1.0) != 1.0:
        _fail("DeepSpeed config: gradient_predivide_factor other than 1.0 is not supported")
    out = _optimizer_settings(ds)
    lr = next((s.value for s in out if s.path == "optimizer.lr"), lr_hint)
    out += _scheduler_settings(ds, lr)
    out += _precision_settings(ds)
    if "gradient_clipping" in ds:
        clip = ds["gradient_clipping"]
        if not isinstance(clip, (int, float)) or clip < 0:
            _fail(f"DeepSpeed config: gradient_clipping must be >= 0, got {clip!r}")
        out.append(Setting("gradient_clipping", "--clip-grad", "optimizer.clip_grad", float(clip)))
    else:
        out.append(Setting("gradient_clipping", "--clip-grad", "optimizer.clip_grad", 0.0, False,
                           absent=True))
    spp = ds.get("steps_per_print", 10)
    if not isinstance(spp, int) or spp < 1:
        _fail(f"DeepSpeed config: steps_per_print must be a positive integer, got {spp!r}")
    out.append(Setting("steps_per_print", "--log-interval", "train.log_interval", spp,
                       "steps_per_print" in ds, absent="steps_per_print" not in ds))
    if "wall_clock_breakdown" in ds:
        out.append(Setting("wall_clock_breakdown", "--wall-clock-breakdown",
                           "train.wall_clock_breakdown", bool(ds["wall_clock_breakdown"])))
    wandb = ds.get("wandb") or {}
    if wandb.get("enabled", False):
        out.append(Setting("wandb.project", "--wandb-project", "train.wandb_project",
                           wandb.get("project") or "deepspeed"))
        if wandb.get("group"):
            out.append(Setting("wandb.group", "--wandb-exp-name", "train.wandb_exp_name",
                               wandb["group"]))
    pipe = ds.get("pipeline") or {}
    extras = {"activation_checkpoint_interval": 0, "stages": None,
              "dataloader_drop_last": bool(ds.get("dataloader_drop_last", False))}
    if not isinstance(pipe, dict):
        _fail('DeepSpeed config: "pipeline" must be an object')
    schedule = pipe.get("schedule", "2bw")
    if schedule not in SCHEDULES:
        _fail(f"DeepSpeed config: pipeline.schedule {schedule!r} is unknown: use one of "
              f"{', '.join(SCHEDULES)} (DeepSpeed's own 1F1B schedule is 'flush')")
    out.append(Setting("pipeline.schedule", "--pipeline-schedule", "schedule", schedule,
                       "schedule" in pipe, absent="schedule" not in pipe))
    interval = pipe.get("activation_checkpoint_interval", 0)
    if not isinstance(interval, int) or interval < 0:
        _fail("DeepSpeed config: pipeline.activation_checkpoint_interval must be an integer >= 0")
    extras["activation_checkpoint_interval"] = interval
    if interval:
        out.append(Setting("pipeline.activation_checkpoint_interval", "--recompute-method",
                           "model.recompute_method", "uniform"))
        out.append(Setting("pipeline.activation_checkpoint_interval", "--recompute-num-layers",
                           "model.recompute_num_layers", interval))
    stages = pipe.get("stages", "auto")
    if stages != "auto":
        if not isinstance(stages, int) or stages < 1:
            _fail(f"DeepSpeed config: pipeline.stages must be 'auto' or a positive integer, got "
                  f"{stages!r}")
        extras["stages"] = stages
        out.append(Setting("pipeline.stages", "--pipeline-model-parallel-size",
                           "parallel.pipeline", stages))
    return out, extras


def _get(cfg: Config, path: str):
    obj = cfg
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _set(cfg: Config, path: str, value) -> None:
    *head, last = path.split(".")
    obj = cfg
    for part in head:
        obj = getattr(obj, part)
    setattr(obj, last, value)


def _check_2bw(cfg: Config, dp: int) -> None:
    m = cfg.batch.global_batch_size // (cfg.batch.micro_batch_size * dp)
    d = cfg.parallel.pipeline
    if cfg.schedule == "2bw" and m < d:
        _fail(f"DeepSpeed config: 2bw needs gradient_accumulation_steps >= pipeline stages (got "
              f"{m} < {d}): raise gradient_accumulation_steps or set \"pipeline\": "
              "{\"schedule\": \"flush\"}")


# -- front door 1: pure DeepSpeed (deepspeed_api.initialize) ----------------------------------------
def config_from_deepspeed(ds, world_size: int, num_stages: int, num_layers: int,
                          seed: int = 1234, rank_order: str = "tp-dp-pp"
                          ) -> tuple[Config, dict]:
    """A validated Config for a DeepSpeed PipelineModule run, and the engine extras. Defaults are
    DeepSpeed's (no clipping, steps_per_print 10, no weight decay unless the optimizer says)."""
    ds = load_ds_json(ds)
    if world_size % num_stages:
        _fail(f"num_stages ({num_stages}) must divide the world size ({world_size})")
    dp = world_size // num_stages
    settings, extras = ds_settings(ds)
    if extras["stages"] is not None and extras["stages"] != num_stages:
        _fail(f"DeepSpeed config: pipeline.stages {extras['stages']} differs from the "
              f"PipelineModule's num_stages {num_stages}")
    micro, gas, tb = batch_triple(ds, dp)
    cfg = Config()
    cfg.model.num_layers = num_layers
    cfg.parallel.pipeline, cfg.parallel.data, cfg.parallel.rank_order = num_stages, dp, rank_order
    cfg.batch.micro_batch_size, cfg.batch.global_batch_size = micro, tb
    cfg.train.seed = seed
    cfg.optimizer.weight_decay = 0.0
    cfg.optimizer.sgd_momentum = 0.0
    for s in settings:
        _set(cfg, s.path, s.value)
    if cfg.optimizer.ds_scheduler is not None:
        total = cfg.optimizer.ds_scheduler["params"].get("total_num_steps")
        cfg.train.train_iters = max(int(total or 1), 1)
    _check_2bw(cfg, dp)
    return cfg.validate(world_size), extras


# -- front door 2: Megatron flags + --deepspeed_config -----------------------------------------------
def _norm_flag(name: str) -> str:
    return "--" + name.lstrip("-").replace("_", "-")


def explicit_flags(argv) -> set[str]:
    """The flags given on a command line (normalized '--name'), for merge_flags_and_ds_config."""
    return {_norm_flag(a.split("=", 1)[0]) for a in argv if a.startswith("--")}


def merge_flags_and_ds_config(cfg: Config, explicit_flag_names, ds_json, world_size=None
                              ) -> Config:
    """Fill `cfg` (built from Megatron flags) from a DeepSpeed JSON (dict or path). A setting the
    JSON gives explicitly and a flag the user typed must agree, else a one-line ConfigError names
    both; otherwise the JSON wins over flag defaults, and flags the user typed win over DeepSpeed
    defaults the JSON only implies (inside a section it has, e.g. an optimizer parameter it leaves
    out). Top-level keys the JSON leaves out change nothing (gradient_clipping stays --clip-grad).
    Call before cfg.validate(world_size)."""
    ds = load_ds_json(ds_json)
    explicit = {_norm_flag(f) for f in explicit_flag_names}
    if world_size is None:
        from .parallel.distributed import env_rank_world
        world_size = env_rank_world()[1]
    settings, _ = ds_settings(ds, lr_hint=cfg.optimizer.lr)

    def conflict(flag, have, key, value):
        _fail(f"{flag} {have} conflicts with {key}={value} in the DeepSpeed config: drop one of "
              "them")

    for s in settings:  # pipeline.stages first: it changes the data-parallel size
        if s.path == "parallel.pipeline":
            if s.flag in explicit and cfg.parallel.pipeline != s.value:
                conflict(s.flag, cfg.parallel.pipeline, s.key, s.value)
            cfg.parallel.pipeline = s.value
    dp = cfg.data_parallel_size(world_size)
    micro_flag = cfg.batch.micro_batch_size if "--micro-batch-size" in explicit else None
    global_flag = cfg.batch.global_batch_size if "--global-batch-size" in explicit else None
    for key, flag, have in (("train_micro_batch_size_per_gpu", "--micro-batch-size", micro_flag),
                            ("train_batch_size", "--global-batch-size", global_flag)):
        if key in ds and have is not None and ds[key] != have:
            conflict(flag, have, key, ds[key])
    micro = ds.get("train_micro_batch_size_per_gpu", micro_flag or cfg.batch.micro_batch_size)
    gas = ds.get("gradient_accumulation_steps")
    if global_flag is not None and gas is not None and "train_batch_size" not in ds \
            and isinstance(micro, int) and micro * gas * dp != global_flag:
        conflict("--global-batch-size", global_flag, "gradient_accumulation_steps",
                 f"{gas} (micro batch {micro} x {gas} x data-parallel size {dp} = "
                 f"{micro * gas * dp})")
    micro, gas, tb = batch_triple(ds, dp, micro=micro, train_batch=global_flag)
    cfg.batch.micro_batch_size, cfg.batch.global_batch_size = micro, tb
    for s in settings:
        if s.path == "parallel.pipeline" or s.absent:
            continue
        if s.flag is not None and s.flag in explicit:
            have = _get(cfg, s.path)
            if s.explicit and have != s.value:
                conflict(s.flag, have, s.key, s.value)
            continue
        _set(cfg, s.path, s.value)
    _check_2bw(cfg, dp)
    return cfg


# -- DeepSpeed's learning-rate schedules, exactly ------------------------------------------------------
def deepspeed_lr(opt_cfg, step: int) -> float:
    """lr of the optimizer step that follows `step` applied (non-skipped) steps, with DeepSpeed's
    arithmetic: the scheduler starts at last_batch_iteration = -1 and steps after every applied
    optimizer step, so step k uses the schedule at k - 1 (k = 0: the warm-up start)."""
    sched = opt_cfg.ds_scheduler
    p, kind, i = sched["params"], sched["type"], step - 1
    warm = max(2, int(p["warmup_num_steps"]))

    def gamma_warm(it):
        if p["warmup_type"] == "log":
            return math.log(it + 1) / math.log(warm)
        return it / warm

    if kind == "WarmupCosineLR":
        if i < 0:
            return 0.0
        if i < warm:
            lo = p["warmup_min_ratio"]
            ratio = lo + gamma_warm(i) * (1.0 - lo)
        else:
            total = max(1, p["total_num_steps"] - warm)
            progress = min(1.0, (i - warm + 1) / total)
            lo = p["cos_min_ratio"]
            ratio = max(0.0, lo + (1.0 - lo) * (1 + math.cos(math.pi * progress)) / 2)
        return opt_cfg.lr * ratio
    lo = float(p["warmup_min_lr"])
    hi = float(p["warmup_max_lr"]) if p.get("warmup_max_lr") is not None else opt_cfg.lr
    if i < 0:
        return lo
    if i < warm:
        gamma = gamma_warm(i)
    elif kind == "WarmupLR":
        gamma = 1.0
    else:
        total = p["total_num_steps"]
        gamma = max(0.0, float(total - i) / float(max(1.0, total - warm)))
    return lo + (hi - lo) * gamma
