"""DeepSpeed settings onto a Config, through either front door: `config_from_deepspeed` (a pure
DeepSpeed run, DeepSpeed's defaults) and `merge_flags_and_ds_config` (Megatron flags plus
--deepspeed_config, a conflict names both). Both are pure: they return a new Config (and the
DeepSpeed-only `DeepSpeedSettings`), and record in `Config.fixed` what the JSON fixed."""
from __future__ import annotations

import dataclasses

from megatron_2bw.config import Config, Fixed
from megatron_2bw.config.ds_json.batch import batch_triple
from megatron_2bw.config.ds_json.engine_settings import DeepSpeedSettings
from megatron_2bw.config.ds_json.read import load_ds_json
from megatron_2bw.config.ds_json.schedulers import DeepSpeedLR
from megatron_2bw.config.ds_json.sections import ds_settings
from megatron_2bw.config.ds_json.setting import Setting, fail
from megatron_2bw.schedule.kinds import schedule_kind

# the batch triple's keys: the Config path each one fixes (m has no field: the planner keeps it)
BATCH_KEYS = (("train_batch_size", "batch.global_batch_size"),
              ("train_micro_batch_size_per_gpu", "batch.micro_batch_size"),
              ("gradient_accumulation_steps", "batch.num_microbatches"))


def _from_json(key: str, value) -> str:
    return f"{key}={value} in the DeepSpeed config"


def _fixed_by_json(ds: dict, settings: list[Setting]) -> tuple[Fixed, ...]:
    """What the JSON states explicitly (not DeepSpeed defaults it implies), by Config path."""
    out = [Fixed(path, _from_json(key, ds[key]), ds[key]) for key, path in BATCH_KEYS
           if key in ds]
    out += [Fixed(s.path, _from_json(s.key, s.value), s.value) for s in settings
            if s.explicit and not s.absent]
    return tuple(out)


def _check_microbatches(cfg: Config) -> None:
    """The schedule's minimum gradient_accumulation_steps, named in DeepSpeed's words."""
    d = cfg.parallel.pipeline
    error = schedule_kind(cfg.schedule).microbatch_error(
        d, cfg.num_microbatches, f"raise gradient_accumulation_steps to at least {d} (DeepSpeed's "
        "default is 1), or set \"pipeline\": {\"schedule\": \"flush\"} (DeepSpeed's own "
        "schedule)")
    if error:
        fail(f"DeepSpeed config: {error}")


def _with_lr_schedule(ds: dict, cfg: Config, settings: DeepSpeedSettings) -> DeepSpeedSettings:
    schedule = DeepSpeedLR.from_json(ds, cfg.optimizer.lr)
    o = cfg.optimizer
    for flag, value in (("--decoupled-lr", o.decoupled_lr), ("--lr-warmup-tokens",
                        o.lr_warmup_tokens), ("--lr-decay-tokens", o.lr_decay_tokens)):
        if schedule is not None and value is not None:
            fail(f"{flag} follows Megatron's lr schedule (--lr-decay-style, ...), not the "
                 "DeepSpeed config's \"scheduler\": drop one of them")
    return dataclasses.replace(settings, lr_schedule=schedule)


# -- front door 1: pure DeepSpeed (megatron_2bw.deepspeed.initialize) ------------------------------
def config_from_deepspeed(ds, world_size: int, num_stages: int, num_layers: int,
                          seed: int = 1234, rank_order: str = "tp-dp-pp",
                          activation_checkpoint_interval: int = 0
                          ) -> tuple[Config, DeepSpeedSettings]:
    """A validated Config for a DeepSpeed PipelineModule run, and the DeepSpeed-only settings.
    Defaults are DeepSpeed's (no clipping, steps_per_print 10, no weight decay unless the
    optimizer says). `activation_checkpoint_interval` is the PipelineModule's; the JSON's
    pipeline.activation_checkpoint_interval wins when it is set."""
    ds = load_ds_json(ds)
    if world_size % num_stages:
        fail(f"num_stages ({num_stages}) must divide the world size ({world_size})")
    dp = world_size // num_stages
    settings, extra = ds_settings(ds)
    if extra.stages is not None and extra.stages != num_stages:
        fail(f"DeepSpeed config: pipeline.stages {extra.stages} differs from the "
             f"PipelineModule's num_stages {num_stages}")
    micro, _, tb = batch_triple(ds, dp)
    interval = extra.activation_checkpoint_interval or activation_checkpoint_interval
    cfg = Config().replace(
        model={"num_layers": num_layers},
        parallel={"pipeline": num_stages, "data": dp, "rank_order": rank_order},
        batch={"micro_batch_size": micro, "global_batch_size": tb}, train={"seed": seed},
        optimizer={"weight_decay": 0.0, "sgd_momentum": 0.0})
    cfg = cfg.replace(**{s.path: s.value for s in settings})
    if interval:
        cfg = cfg.replace(model={"recompute_granularity": "full", "recompute_method": "uniform",
                                 "recompute_num_layers": interval})
    extra = _with_lr_schedule(ds, cfg, extra)
    if extra.lr_schedule is not None:
        cfg = cfg.replace(train={"train_iters": max(int(extra.lr_schedule.total_num_steps or 1),
                                                    1)})
    cfg = cfg.replace(fixed=_fixed_by_json(ds, settings))
    _check_microbatches(cfg)
    return cfg.validate(world_size), extra


# -- front door 2: Megatron flags + --deepspeed_config ---------------------------------------------
def _norm_flag(name: str) -> str:
    return "--" + name.lstrip("-").replace("_", "-")


def explicit_flags(argv) -> set[str]:
    """The flags given on a command line (normalized '--name'), for merge_flags_and_ds_config."""
    return {_norm_flag(a.split("=", 1)[0]) for a in argv if a.startswith("--")}


def _conflict(flag, have, key, value):
    fail(f"{flag} {have} conflicts with {key}={value} in the DeepSpeed config: drop one of them")


def _merge_batch(cfg: Config, ds: dict, explicit: set, world_size: int, layout_free: bool
                 ) -> Config:
    """The batch triple onto cfg.batch. With `layout_free` (--auto-plan: the planner picks the
    data-parallel size) the keys the JSON gives are taken as they are; the planner keeps them."""
    micro_flag = cfg.batch.micro_batch_size if "--micro-batch-size" in explicit else None
    global_flag = cfg.batch.global_batch_size if "--global-batch-size" in explicit else None
    for key, flag, have in (("train_micro_batch_size_per_gpu", "--micro-batch-size", micro_flag),
                            ("train_batch_size", "--global-batch-size", global_flag)):
        if key in ds and have is not None and ds[key] != have:
            _conflict(flag, have, key, ds[key])
    micro = ds.get("train_micro_batch_size_per_gpu", micro_flag or cfg.batch.micro_batch_size)
    if layout_free:
        tb = ds.get("train_batch_size", cfg.batch.global_batch_size)
        return cfg.replace(batch={"micro_batch_size": micro, "global_batch_size": tb})
    dp = cfg.resolved(world_size).data_parallel_size
    gas = ds.get("gradient_accumulation_steps")
    if global_flag is not None and gas is not None and "train_batch_size" not in ds \
            and isinstance(micro, int) and micro * gas * dp != global_flag:
        _conflict("--global-batch-size", global_flag, "gradient_accumulation_steps",
                  f"{gas} (micro batch {micro} x {gas} x data-parallel size {dp} = "
                  f"{micro * gas * dp})")
    micro, _, tb = batch_triple(ds, dp, micro=micro, train_batch=global_flag)
    return cfg.replace(batch={"micro_batch_size": micro, "global_batch_size": tb})


def merge_flags_and_ds_config(cfg: Config, explicit_flag_names, ds_json, world_size=None,
                              layout_free: bool = False) -> tuple[Config, DeepSpeedSettings]:
    """A new Config: `cfg` (built from Megatron flags) with a DeepSpeed JSON (dict or path) on
    top, and the DeepSpeed-only settings. A setting the JSON gives explicitly and a flag the user
    typed must agree, else a one-line ConfigError names both; otherwise the JSON wins over flag
    defaults, and flags the user typed win over DeepSpeed defaults the JSON only implies (inside a
    section it has, e.g. an optimizer parameter it leaves out). Top-level keys the JSON leaves out
    change nothing (gradient_clipping stays --clip-grad). What the JSON states is recorded in
    `Config.fixed`. `layout_free`: the planner chooses the layout (--auto-plan), so the batch
    triple is not resolved against the flags' data-parallel size. Not validated here."""
    ds = load_ds_json(ds_json)
    explicit = {_norm_flag(f) for f in explicit_flag_names}
    if world_size is None:
        from megatron_2bw.config.launcher_env import env_rank_world
        world_size = env_rank_world()[1]
    settings, extra = ds_settings(ds, lr_hint=cfg.optimizer.lr)
    for s in settings:  # pipeline.stages first: it changes the data-parallel size
        if s.path == "parallel.pipeline":
            if s.flag in explicit and cfg.parallel.pipeline != s.value:
                _conflict(s.flag, cfg.parallel.pipeline, s.key, s.value)
            cfg = cfg.replace(parallel={"pipeline": s.value})
    cfg = _merge_batch(cfg, ds, explicit, world_size, layout_free)
    changes = {}
    for s in settings:
        if s.path == "parallel.pipeline" or s.absent:
            continue
        if s.flag is not None and s.flag in explicit:
            have = cfg.get(s.path)
            if s.explicit and have != s.value:
                _conflict(s.flag, have, s.key, s.value)
            continue
        changes[s.path] = s.value
    cfg = cfg.replace(**changes)
    cfg = cfg.replace(fixed=cfg.fixed + _fixed_by_json(ds, settings))
    if not layout_free:
        _check_microbatches(cfg.resolved(world_size))
    return cfg, _with_lr_schedule(ds, cfg, extra)

