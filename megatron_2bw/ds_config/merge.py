"""DeepSpeed settings onto a Config, through either front door: `config_from_deepspeed` (a pure
DeepSpeed run, DeepSpeed's defaults) and `merge_flags_and_ds_config` (Megatron flags plus
--deepspeed_config, a conflict names both)."""
from __future__ import annotations

from operator import attrgetter

from ..config import Config
from ..pipeline.registry import schedule_kind
from .batch import batch_triple
from .read import load_ds_json
from .sections import ds_settings
from .setting import fail


def _set(cfg: Config, path: str, value) -> None:
    head, _, last = path.rpartition(".")
    setattr(attrgetter(head)(cfg) if head else cfg, last, value)


def _check_microbatches(cfg: Config, dp: int) -> None:
    """The schedule's minimum gradient_accumulation_steps, named in DeepSpeed's words."""
    m = cfg.batch.global_batch_size // (cfg.batch.micro_batch_size * dp)
    error = schedule_kind(cfg.schedule).microbatch_error(
        cfg.parallel.pipeline, m, "raise gradient_accumulation_steps or set \"pipeline\": "
        "{\"schedule\": \"flush\"}")
    if error:
        fail(f"DeepSpeed config: {error}")


# -- front door 1: pure DeepSpeed (megatron_2bw.deepspeed.initialize) ------------------------------
def config_from_deepspeed(ds, world_size: int, num_stages: int, num_layers: int,
                          seed: int = 1234, rank_order: str = "tp-dp-pp"
                          ) -> tuple[Config, dict]:
    """A validated Config for a DeepSpeed PipelineModule run, and the engine extras. Defaults are
    DeepSpeed's (no clipping, steps_per_print 10, no weight decay unless the optimizer says)."""
    ds = load_ds_json(ds)
    if world_size % num_stages:
        fail(f"num_stages ({num_stages}) must divide the world size ({world_size})")
    dp = world_size // num_stages
    settings, extras = ds_settings(ds)
    if extras["stages"] is not None and extras["stages"] != num_stages:
        fail(f"DeepSpeed config: pipeline.stages {extras['stages']} differs from the "
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
    _check_microbatches(cfg, dp)
    return cfg.validate(world_size), extras


# -- front door 2: Megatron flags + --deepspeed_config ---------------------------------------------
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
        from ..parallel.distributed import env_rank_world
        world_size = env_rank_world()[1]
    settings, _ = ds_settings(ds, lr_hint=cfg.optimizer.lr)

    def conflict(flag, have, key, value):
        fail(f"{flag} {have} conflicts with {key}={value} in the DeepSpeed config: drop one of "
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
            have = attrgetter(s.path)(cfg)
            if s.explicit and have != s.value:
                conflict(s.flag, have, s.key, s.value)
            continue
        _set(cfg, s.path, s.value)
    _check_microbatches(cfg, dp)
    return cfg
