"""deepspeed.initialize / init_distributed / add_config_arguments: the drop-in's entry points
(package docstring)."""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch

from megatron_2bw.config import ConfigError
from megatron_2bw.config.ds_json import config_from_deepspeed, load_ds_json
from megatron_2bw.config.launcher_env import env_rank_world
from megatron_2bw.config.numbers import is_finite
from megatron_2bw.deepspeed.engine import DeepSpeedPipelineEngine
from megatron_2bw.deepspeed.pipe.module import PipelineModule, _is_ds_pipeline_module
from megatron_2bw.deepspeed.pipe.topology import grid_layout
from megatron_2bw.parallel.devices import default_backend, default_device, is_initialized
from megatron_2bw.parallel.distributed import current_rank_world, init_process_group
from megatron_2bw.parallel.launcher import discover_env, launched
from megatron_2bw.training.reliability import watch_launcher

__all__ = ["DeepSpeedPipelineEngine", "add_config_arguments", "init_distributed", "initialize"]


# -- process group --------------------------------------------------------------------------------
def _env_minutes() -> float | None:
    """DeepSpeed's default group timeout (deepspeed/constants.py): DEEPSPEED_TIMEOUT minutes,
    else 10; None when the variable holds no number of minutes > 0."""
    raw = os.environ.get("DEEPSPEED_TIMEOUT")
    if raw is None:
        return 10.0
    try:
        minutes = float(raw)
    except ValueError:
        return None
    return minutes if is_finite(minutes) and minutes > 0 else None


_ENV_MINUTES = _env_minutes()
default_pg_timeout = datetime.timedelta(minutes=_ENV_MINUTES or 10)


def init_distributed(dist_backend=None, auto_mpi_discovery=True, distributed_port=29500,
                     verbose=True, timeout=default_pg_timeout, init_method=None,
                     dist_init_required=None, config=None, rank=-1, world_size=-1) -> None:
    """Start torch.distributed like deepspeed.init_distributed: nccl on GPUs, gloo otherwise;
    rank and world from torchrun, SLURM or MPI variables. A no-op when already initialized.
    Order: the rank's GPU (from LOCAL_RANK) made current, then the group bound to it."""
    if is_initialized():
        return
    if dist_init_required is False:
        raise ConfigError("torch.distributed is not initialized and dist_init_required=False: "
                          "call init_distributed() first")
    if launched():
        watch_launcher()  # a worker never outlives its launcher
    if auto_mpi_discovery:
        discover_env(distributed_port)
    env_rank, env_world, local_rank = env_rank_world()
    rank = env_rank if rank < 0 else rank
    world_size = env_world if world_size < 0 else world_size
    minutes = timeout.total_seconds() / 60
    if timeout is default_pg_timeout:  # the variable sets the default, read as the call starts
        minutes = _env_minutes()
        if minutes is None:
            raise ConfigError(f"DEEPSPEED_TIMEOUT={os.environ.get('DEEPSPEED_TIMEOUT')!r}: the "
                              "process group timeout must be a number of minutes > 0; unset "
                              "it for the default")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(distributed_port))
    backend = dist_backend or default_backend()
    init_process_group(rank, world_size, backend, minutes, init_method or "env://",
                       device=default_device(local_rank, backend))


def add_config_arguments(parser):
    """deepspeed.add_config_arguments: --deepspeed and --deepspeed_config (and the old names);
    ours: --deepspeed_strict (an unknown config key is an error, not a warning)."""
    g = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    g.add_argument("--deepspeed", default=False, action="store_true")
    g.add_argument("--deepspeed_config", default=None, type=str)
    g.add_argument("--deepspeed_strict", default=False, action="store_true",
                   help="refuse config keys DeepSpeed would ignore (default: one warning each)")
    g.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    g.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


# -- initialize -----------------------------------------------------------------------------------
def _optimizer_section(opt) -> dict:
    """A DeepSpeed "optimizer" section equivalent to a torch optimizer object."""
    d = opt.defaults
    for g in opt.param_groups:
        if any(g.get(k) != d.get(k) for k in ("lr", "weight_decay", "momentum", "betas")):
            raise ConfigError("per-parameter-group optimizer settings are not supported: the "
                              "engine decays matrices and embeddings, not biases or norms")
    if isinstance(opt, (torch.optim.AdamW, torch.optim.Adam)):
        decoupled = isinstance(opt, torch.optim.AdamW)  # checked first: AdamW may subclass Adam
        params = {"lr": d["lr"], "betas": list(d["betas"]), "eps": d["eps"],
                  "weight_decay": d["weight_decay"]}
        if not decoupled:
            params["adam_w_mode"] = False
        return {"type": "AdamW" if decoupled else "Adam", "params": params}
    if isinstance(opt, torch.optim.SGD):
        return {"type": "SGD", "params": {"lr": d["lr"], "momentum": d["momentum"],
                                          "weight_decay": d["weight_decay"],
                                          "nesterov": d["nesterov"], "dampening": d["dampening"]}}
    raise ConfigError(f"optimizer {type(opt).__name__} is not supported: pass Adam, AdamW or SGD "
                      "(or an \"optimizer\" section in the config)")


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, mpu=None, dist_init_required=None, collate_fn=None, config=None,
               config_params=None, strict=False, **unused):
    """deepspeed.initialize for a PipelineModule: returns (engine, optimizer, training
    dataloader, lr scheduler). Every configuration error is a one-line ConfigError raised before
    this function creates any process group. An unknown key DeepSpeed ignores is one warning
    line (rank 0) unless `strict`, args.deepspeed_strict or the JSON's "strict" says refuse."""
    ds = load_ds_json(config, args, config_params)
    if strict or getattr(args, "deepspeed_strict", False):
        ds["strict"] = True
    if _is_ds_pipeline_module(model):
        model = PipelineModule.from_deepspeed(model)
    if not isinstance(model, PipelineModule):
        raise ConfigError(f"initialize trains a megatron_2bw.deepspeed.pipe.PipelineModule "
                          f"(or DeepSpeed's), got {type(model).__name__}")
    if optimizer is not None:
        if callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError("an optimizer factory is not supported: give an \"optimizer\" "
                              "section in the config")
        if "optimizer" in ds:
            raise ConfigError("optimizer given twice (the optimizer argument and the config's "
                              "\"optimizer\" section): pass one")
        ds["optimizer"] = _optimizer_section(optimizer)
    if lr_scheduler is not None:
        raise ConfigError("a client lr_scheduler object is not supported: give a \"scheduler\" "
                          "section (WarmupLR, WarmupDecayLR, WarmupCosineLR) in the config")
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    if frozen:
        raise ConfigError(f"frozen parameter {frozen[0]!r} (requires_grad=False): the 2BW engine "
                          "trains every parameter of the PipelineModule")
    _, world = current_rank_world()
    layout = grid_layout(model.topology())
    cfg, settings = config_from_deepspeed(
        ds, world, model.num_stages, model._num_layers, seed=model.base_seed,
        rank_order=layout["rank_order"],
        activation_checkpoint_interval=model.activation_checkpoint_interval)
    if settings.activation_checkpoint_interval:
        model.set_checkpoint_interval(settings.activation_checkpoint_interval)
    if settings.notes and current_rank_world()[0] == 0:
        print("\n".join(settings.notes), file=sys.stderr, flush=True)
    if ds.get("activation_checkpointing") is not None:   # deepspeed.checkpointing, configured
        from megatron_2bw.deepspeed import checkpointing
        checkpointing.configure(None, deepspeed_config=ds, use_reentrant=settings.use_reentrant,
                                warn=False)
    # -- configuration is valid: from here on, process groups ------------------------------------
    if not is_initialized():
        init_distributed(dist_init_required=dist_init_required)
    engine = DeepSpeedPipelineEngine(model, cfg, ds, settings, training_data=training_data,
                                     collate_fn=collate_fn)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler
