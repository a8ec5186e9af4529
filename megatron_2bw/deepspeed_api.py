"""`deepspeed.initialize` / `init_distributed` and a pipeline engine with DeepSpeed's contract,
running on the 2BW engine (or flush / gpipe: `"pipeline": {"schedule": ...}`, default 2bw).

    import megatron_2bw as deepspeed          # the only line a DeepSpeed script changes
    deepspeed.init_distributed(dist_backend="gloo")
    net = deepspeed.pipe.PipelineModule(layers=..., num_stages=2, loss_fn=...)
    engine, _, _, _ = deepspeed.initialize(model=net, config="ds_config.json")
    for step in range(steps):
        loss = engine.train_batch(data_iter)

Contract differences that come from 2BW itself: the engine pulls the first microbatches of batch
t+1 while it finishes batch t, so `train_batch` wants one long iterator (e.g. RepeatingLoader),
not an exactly-sized one per call (flush and gpipe read exactly m per call, like DeepSpeed); and
`engine.module` holds the newest of the two weight versions (it is re-pointed after each batch).

Checkpoints use DeepSpeed's layout:
    <dir>/latest                                       the tag
    <dir>/<tag>/layer_{idx:02d}-model_states.pt        one layer's weights (fp32), any layout
    <dir>/<tag>/mp_rank_{stage:02d}_model_states.pt    a stage's engine state (both 2BW versions,
                                                       optimizer, scaler, steps) + client_state
Per-layer files make weights loadable under a different stage count; the optimizer state and the
2BW previous version are then re-sharded by parameter name from all stage files.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import os
import re
import time

import torch
import torch.distributed as dist

from .config import ConfigError
from .ds_config import config_from_deepspeed, load_ds_json
from .parallel.distributed import default_backend, default_device, env_rank_world
from .parallel.grid import ProcessGrid
from .pipe.module import PipelineError, PipelineModule, _is_ds_pipeline_module, rank_world
from .pipe.topology import grid_layout
from .utils import RepeatingLoader

__all__ = ["DeepSpeedPipelineEngine", "add_config_arguments", "init_distributed", "initialize"]

STATE_KEYS = ("module", "buffer_names", "optimizer", "lr_scheduler", "global_steps",
              "global_samples", "skipped_steps", "dp_world_size", "mp_world_size", "ds_config",
              "ds_version", "megatron_2bw")


# -- process group --------------------------------------------------------------------------------
def _first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list such as 'gpu[003-005,9],cpu1' (no scontrol needed)."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        return nodelist
    prefix, ranges = m.group(1), m.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _discover_env(port: int) -> None:
    """Fill RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT from SLURM or MPI variables when a
    launcher other than torchrun started us (torchrun sets them all already)."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        env.setdefault("LOCAL_RANK", "0")
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_NTASKS"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        from .parallel import distributed
        if hasattr(distributed, "slurm_rendezvous"):  # first host of the job, port from job id
            distributed.slurm_rendezvous()
        nodes = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if "MASTER_ADDR" not in env and nodes:
            env["MASTER_ADDR"] = _first_slurm_host(nodes)
    else:
        for r, w, lr, ls in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                              "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
                             ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")):
            if r in env and w in env:
                env["RANK"], env["WORLD_SIZE"] = env[r], env[w]
                env["LOCAL_RANK"] = env.get(lr, "0")
                if "MASTER_ADDR" not in env:
                    if env.get(ls, env[w]) != env[w]:
                        raise ConfigError("multi-node MPI launch without MASTER_ADDR: export "
                                          "MASTER_ADDR=<first node> (and MASTER_PORT)")
                break
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(port))


def init_distributed(dist_backend=None, auto_mpi_discovery=True, distributed_port=29500,
                     verbose=True, timeout=datetime.timedelta(minutes=30), init_method=None,
                     dist_init_required=None, config=None, rank=-1, world_size=-1) -> None:
    """Start torch.distributed like deepspeed.init_distributed: nccl on GPUs, gloo otherwise;
    rank and world from torchrun, SLURM or MPI variables. A no-op when already initialized."""
    if dist.is_initialized():
        return
    if dist_init_required is False:
        raise ConfigError("torch.distributed is not initialized and dist_init_required=False: "
                          "call init_distributed() first")
    if auto_mpi_discovery:
        _discover_env(distributed_port)
    env_rank, env_world, _ = env_rank_world()
    rank = env_rank if rank < 0 else rank
    world_size = env_world if world_size < 0 else world_size
    minutes = float(os.environ.get("DEEPSPEED_TIMEOUT", timeout.total_seconds() / 60))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(distributed_port))
    dist.init_process_group(backend=dist_backend or default_backend(), rank=rank,
                            world_size=world_size, init_method=init_method or "env://",
                            timeout=datetime.timedelta(minutes=minutes))


def add_config_arguments(parser):
    """deepspeed.add_config_arguments: --deepspeed and --deepspeed_config (and the old names)."""
    g = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    g.add_argument("--deepspeed", default=False, action="store_true")
    g.add_argument("--deepspeed_config", default=None, type=str)
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
    if isinstance(opt, torch.optim.AdamW):
        return {"type": "AdamW", "params": {"lr": d["lr"], "betas": list(d["betas"]),
                                            "eps": d["eps"], "weight_decay": d["weight_decay"]}}
    if isinstance(opt, torch.optim.Adam):
        return {"type": "Adam", "params": {"lr": d["lr"], "betas": list(d["betas"]),
                                           "eps": d["eps"], "weight_decay": d["weight_decay"],
                                           "adam_w_mode": False}}
    if isinstance(opt, torch.optim.SGD):
        return {"type": "SGD", "params": {"lr": d["lr"], "momentum": d["momentum"],
                                          "weight_decay": d["weight_decay"],
                                          "nesterov": d["nesterov"], "dampening": d["dampening"]}}
    raise ConfigError(f"optimizer {type(opt).__name__} is not supported: pass Adam, AdamW or SGD "
                      "(or an \"optimizer\" section in the config)")


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, mpu=None, dist_init_required=None, collate_fn=None, config=None,
               config_params=None, **unused):
    """deepspeed.initialize for a PipelineModule: returns (engine, optimizer, training
    dataloader, lr scheduler). Every configuration error is a one-line ConfigError raised before
    this function creates any process group."""
    ds = load_ds_json(config, args, config_params)
    if _is_ds_pipeline_module(model):
        model = PipelineModule.from_deepspeed(model)
    if not isinstance(model, PipelineModule):
        raise ConfigError(f"initialize trains a megatron_2bw.pipe.PipelineModule (or DeepSpeed's), "
                          f"got {type(model).__name__}")
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
    _, world = rank_world()
    layout = grid_layout(model.topology())
    cfg, extras = config_from_deepspeed(ds, world, model.num_stages, model._num_layers,
                                        seed=model.base_seed, rank_order=layout["rank_order"])
    if extras["activation_checkpoint_interval"]:
        model.activation_checkpoint_interval = extras["activation_checkpoint_interval"]
    if model.activation_checkpoint_interval:
        cfg.model.recompute_method = "uniform"
        cfg.model.recompute_num_layers = model.activation_checkpoint_interval
    # -- configuration is valid: from here on, process groups ------------------------------------
    if not dist.is_initialized():
        init_distributed(dist_init_required=dist_init_required)
    engine = DeepSpeedPipelineEngine(model, cfg, ds, extras, training_data=training_data,
                                     collate_fn=collate_fn)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


# -- the engine -----------------------------------------------------------------------------------
class _MPU:
    """DeepSpeed's PipelineParallelGrid queries over our ProcessGrid."""

    def __init__(self, grid: ProcessGrid):
        self.grid = grid
        self.pipe_parallel_size, self.data_parallel_size = grid.pipeline, grid.data
        self.model_parallel_size = grid.tensor
        self.stage_id, self.data_parallel_id = grid.stage, grid.dp_rank

    def get_global_rank(self):
        return self.grid.rank

    def get_stage_id(self):
        return self.grid.stage

    def get_pipe_parallel_rank(self):
        return self.grid.stage

    def get_pipe_parallel_world_size(self):
        return self.grid.pipeline

    def get_pipe_parallel_group(self):
        return self.grid.group("pp")

    def get_data_parallel_rank(self):
        return self.grid.dp_rank

    def get_data_parallel_world_size(self):
        return self.grid.data

    def get_data_parallel_group(self):
        return self.grid.group("dp")

    def get_model_parallel_rank(self):
        return self.grid.tp_rank

    def get_model_parallel_world_size(self):
        return self.grid.tensor

    def get_model_parallel_group(self):
        return self.grid.group("tp")

    def get_slice_parallel_rank(self):
        return self.grid.tp_rank

    def get_slice_parallel_world_size(self):
        return self.grid.tensor

    def stage_to_global(self, stage_id, data=None, model=0):
        tp, _, dp = self.grid.coords()
        return self.grid.rank_of(model if model is not None else tp, stage_id,
                                 dp if data is None else data)


class _OptimizerView:
    """What DeepSpeed returns as the optimizer: param_groups with the current lr; the engine
    steps it (flat buffers, both 2BW versions) inside train_batch."""

    def __init__(self, engine: "DeepSpeedPipelineEngine"):
        self._engine = engine

    @property
    def param_groups(self):
        c = self._engine._cfg.optimizer
        group = {"lr": self._engine.get_lr()[0], "weight_decay": c.weight_decay,
                 "params": list(self._engine.module.parameters())}
        if c.name == "adam":
            group.update(betas=(c.adam_beta1, c.adam_beta2), eps=c.adam_eps)
        else:
            group.update(momentum=c.sgd_momentum)
        return [group]

    def state_dict(self):
        return self._engine._engine.stepper.optimizer.state_dict()

    def load_state_dict(self, state):
        self._engine._engine.stepper.optimizer.load_state_dict(state)

    def zero_grad(self, set_to_none=True):
        pass

    def step(self, *a, **k):
        raise PipelineError("the optimizer is stepped by engine.train_batch()")


class _LRSchedulerView:
    """DeepSpeed's scheduler object: the lr is a function of the applied steps (the engine
    advances it); step() is a no-op so a script that calls it does not advance it twice."""

    def __init__(self, engine: "DeepSpeedPipelineEngine"):
        self._engine = engine

    def get_lr(self):
        return self._engine.get_lr()

    def get_last_lr(self):
        return self._engine.get_lr()  # DeepSpeed: the lr its last step() set, for the next step

    def step(self, *a, **k):
        pass

    def state_dict(self):
        return {"last_batch_iteration": self._engine.global_steps - 1}

    def load_state_dict(self, state):
        pass


class _Feed:
    """The engine's data iterator: pulls (inputs, labels) from the current source, applies the
    batch function, and turns running dry into a one-line explanation."""

    def __init__(self, source, engine, what: str):
        self.source, self.engine, self.what = source, engine, what

    def __iter__(self):
        return self

    def __next__(self):
        it = self.source()
        if it is None:
            raise RuntimeError(f"{self.what} has no data: pass data_iter (or training_data to "
                               "initialize)")
        try:
            batch = next(it)
        except StopIteration:
            extra = (" 2bw reads the first microbatches of the next batch ahead: pass one long "
                     "iterator such as deepspeed.utils.RepeatingLoader to every call, or use "
                     "\"pipeline\": {\"schedule\": \"flush\"}"
                     if self.what == "train_batch" and self.engine._cfg.schedule == "2bw" else "")
            raise RuntimeError(f"{self.what}: the data iterator ran out.{extra}") from None
        if self.engine.batch_fn is not None:
            batch = self.engine.batch_fn(batch)
        inputs, labels = batch[0], batch[1]
        if isinstance(inputs, list):
            inputs = tuple(inputs)
        return inputs, labels


class DeepSpeedPipelineEngine:
    """DeepSpeed's PipelineEngine contract over megatron_2bw.pipeline.engine.PipelineEngine."""

    def __init__(self, module: PipelineModule, cfg, ds_json: dict, extras: dict,
                 training_data=None, collate_fn=None):
        from .pipeline.engine import PipelineEngine
        self._cfg, self._config, self._extras = cfg, ds_json, extras
        self.module = module
        self.global_rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", env_rank_world()[2]))
        self.device = default_device(self.local_rank, dist.get_backend())
        grid = ProcessGrid(1, cfg.parallel.pipeline, cfg.parallel.data, rank=self.global_rank,
                           rank_order=cfg.parallel.rank_order).init_groups()
        if grid.stage != module.stage_id:
            raise RuntimeError(f"rank {self.global_rank}: grid stage {grid.stage} != module stage "
                               f"{module.stage_id}")
        self.grid = _MPU(grid)
        module._grid = self.grid
        self._sync_initial_weights(grid)
        self._compute_loss, self._capture = True, None
        self._engine = PipelineEngine(cfg, grid, module.engine_specs(), self._loss, module.parts,
                                      self.device)
        stepper = self._engine.stepper
        if cfg.optimizer.ds_scheduler is not None:  # DeepSpeed does not step it on skipped steps
            base = stepper.lr
            stepper.lr = lambda t: base(t - stepper.skipped)
        module.adopt(self._engine.module)
        self.num_stages, self.stage_id = grid.pipeline, grid.stage
        self.micro_batch_size = cfg.batch.micro_batch_size
        self.micro_batches = cfg.num_microbatches(self.world_size)
        self.dp_world_size, self.mp_world_size = grid.data, grid.tensor
        self.global_samples = 0
        self.agg_train_loss = None
        self.data_iterator = None
        self.batch_fn = None
        self.training_dataloader = None
        self.optimizer = _OptimizerView(self)
        self.lr_scheduler = _LRSchedulerView(self) if cfg.optimizer.ds_scheduler else None
        self._feed = _Feed(lambda: self.data_iterator, self, "train_batch")
        self._timer = time.perf_counter()
        self._wandb = None
        if training_data is not None:
            self._build_data_iter(training_data, collate_fn)

    # -- set-up helpers ---------------------------------------------------------------------------
    def _sync_initial_weights(self, grid: ProcessGrid) -> None:
        """Tied copies from the first stage, then every replica from data-parallel rank 0 (what
        DeepSpeed does in PipelineModule.__init__ and DeepSpeedEngine.__init__)."""
        self.module.to(self.device)
        tied_group = grid.group("tied")
        if tied_group is not None:
            src = min(grid.group_ranks("tied"))
            for _, p in self.module.tied_sync_params():
                with torch.no_grad():
                    dist.broadcast(p.data, src=src, group=tied_group)
        dp_group = grid.group("dp")
        if dp_group is not None:
            tp, pp, _ = grid.coords()
            src = grid.rank_of(tp, pp, 0)
            with torch.no_grad():
                for t in list(self.module.parameters()) + list(self.module.buffers()):
                    dist.broadcast(t.data, src=src, group=dp_group)

    def _build_data_iter(self, dataset, collate_fn) -> None:
        from torch.utils.data import DataLoader, DistributedSampler
        sampler = DistributedSampler(dataset, num_replicas=self.dp_world_size,
                                     rank=self.grid.get_data_parallel_rank(), shuffle=False)
        loader = DataLoader(dataset, batch_size=self.micro_batch_size, sampler=sampler,
                            collate_fn=collate_fn,
                            drop_last=self._extras.get("dataloader_drop_last", False))
        self.set_dataloader(RepeatingLoader(loader))

    def _loss(self, outputs, labels):
        if self._capture is not None:
            self._capture.append(outputs.detach() if torch.is_tensor(outputs)
                                 else tuple(o.detach() for o in outputs))
        if not self._compute_loss:
            return torch.zeros((), device=self.device)
        if self.module.loss_fn is None:
            return outputs
        return self.module.loss_fn(outputs, labels)

    # -- DeepSpeed API: training ------------------------------------------------------------------
    def train_batch(self, data_iter=None):
        """Train one batch of micro_batches microbatches per pipeline; returns the batch's mean
        loss (over microbatches and data-parallel replicas) on every rank."""
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled. Use eval_batch() "
                               "instead.")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        if self.data_iterator is None and (self.is_first_stage() or self.is_last_stage()):
            raise RuntimeError("train_batch() has no data: pass data_iter, call "
                               "set_dataiterator(), or give training_data to initialize()")
        loss = self._engine.train_batch(self._feed)
        self.module.adopt(self._engine.module)
        self.global_samples += self.train_batch_size()
        self.agg_train_loss = loss
        if self.global_steps % self.steps_per_print() == 0:
            self._report(loss)
        return loss

    def _report(self, loss) -> None:
        now = time.perf_counter()
        iter_time = (now - self._timer) / self.steps_per_print()
        self._timer = now
        value = float(loss)  # the only host read: once per steps_per_print
        if self.global_rank == 0:
            print(f"steps: {self.global_steps} loss: {value:0.4f} iter time (s): {iter_time:0.3f} "
                  f"samples/sec: {self.train_batch_size() / iter_time:0.3f}", flush=True)
            if self._cfg.train.wall_clock_breakdown:
                timers = getattr(self._engine, "timers", {})
                print("time (ms) | " + " | ".join(f"{k}: {1000 * v:.2f}"
                                                 for k, v in sorted(timers.items())), flush=True)
            if self._cfg.train.wandb_project:
                self._log_wandb({"Train/Samples/train_loss": value,
                                 "Train/Samples/lr": self.get_lr()[0]})
        if hasattr(self._engine, "timers"):
            self._engine.timers.clear()

    def _log_wandb(self, values: dict) -> None:
        if self._wandb is None:
            os.environ.setdefault("WANDB_MODE", "offline")
            import wandb
            self._wandb = wandb.init(project=self._cfg.train.wandb_project,
                                     group=self._cfg.train.wandb_exp_name,
                                     config=self._config)
        self._wandb.log(values, step=self.global_samples)

    def eval_batch(self, data_iter, return_logits=False, compute_loss=True, reduce_output="avg",
                   bcast_loss=True, num_micro_batches=None):
        """Forward-only over num_micro_batches (default: micro_batches) microbatches on the newest
        weights; leaves the in-flight 2BW state untouched. Returns the mean loss on every rank
        (with compute_loss=False: the outputs, averaged or as a list, on the last stage)."""
        if reduce_output not in (None, "avg"):
            raise NotImplementedError(f"reduction type {reduce_output} not supported.")
        n = num_micro_batches or self.micro_batches
        data_iter = _as_iterator(data_iter)
        keep = return_logits or not compute_loss
        self._capture = [] if keep and self.is_last_stage() else None
        self._compute_loss = compute_loss
        try:
            loss = self._engine.eval_batch(_Feed(lambda: data_iter, self, "eval_batch"), n)
        finally:
            outputs, self._capture, self._compute_loss = self._capture, None, True
        result = loss
        if not compute_loss:
            result = None
            if self.is_last_stage():
                result = outputs if reduce_output is None else self._average(outputs, n)
        if return_logits:
            return result, (outputs[-1] if outputs else None)
        return result

    def _average(self, outputs, n):
        tensors = isinstance(outputs[0], torch.Tensor)
        parts = [outputs] if tensors else list(zip(*outputs))
        reduced = [sum(p) / n for p in parts]
        group = self.grid.get_data_parallel_group()
        for t in reduced:
            if group is not None:
                dist.all_reduce(t, group=group)
                t.div_(self.dp_world_size)
        return reduced[0] if tensors else reduced

    def set_dataloader(self, loader):
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = loader
            self.data_iterator = iter(loader)

    def set_dataiterator(self, iterator):
        """The iterator train_batch reads (first and last stage only, like DeepSpeed)."""
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = None
            self.data_iterator = _as_iterator(iterator)

    def set_batch_fn(self, fn):
        """Post-process every microbatch pulled from the data iterator."""
        self.batch_fn = fn

    def is_first_stage(self):
        return self.stage_id == 0

    def is_last_stage(self):
        return self.stage_id == self.num_stages - 1

    # -- DeepSpeed API: queries -------------------------------------------------------------------
    @property
    def global_steps(self) -> int:
        return self._engine.iteration

    @property
    def skipped_steps(self) -> int:
        return self._engine.skipped_iterations

    def train_batch_size(self):
        return self._cfg.batch.global_batch_size

    def train_micro_batch_size_per_gpu(self):
        return self.micro_batch_size

    def gradient_accumulation_steps(self):
        return self.micro_batches

    def steps_per_print(self):
        return self._cfg.train.log_interval

    def wall_clock_breakdown(self):
        return self._cfg.train.wall_clock_breakdown

    def fp16_enabled(self):
        return self._cfg.precision.dtype == "fp16"

    def bfloat16_enabled(self):
        return self._cfg.precision.dtype == "bf16"

    def get_lr(self):
        """[lr of the next optimizer step]."""
        return [float(self._engine.stepper.lr(self.global_steps))]

    def get_global_grad_norm(self):
        return float(self._engine.last_grad_norm)

    def get_pipeline_parallel_rank(self):
        return self.stage_id

    def was_step_applied(self):
        return True

    def schedule(self) -> str:
        return self._cfg.schedule

    def fp32_state(self) -> dict:
        """Newest fp32 weights of this stage by engine parameter name."""
        return self._engine.fp32_state()

    def train(self, mode=True):
        self.module.train(mode)

    def eval(self):
        self.module.eval()

    def reset_activation_shape(self):
        pass

    def forward(self, *a, **k):
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    __call__ = forward

    def backward(self, *a, **k):
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    def step(self, *a, **k):
        raise PipelineError("Only train_batch() is accessible in pipeline mode.")

    # -- checkpoints ------------------------------------------------------------------------------
    def _state_file(self, path: str, stage: int | None = None) -> str:
        return os.path.join(path, f"mp_rank_{self.stage_id if stage is None else stage:02d}"
                                  "_model_states.pt")

    def _layer_state_dicts(self) -> dict[int, dict]:
        """Newest weights of every local layer that has any state, in fp32, by layer index."""
        eng = self._engine
        newest = eng.module
        fp32 = eng.fp32_state()
        by_id = {id(p): fp32[name] for name, p in newest.named_parameters()}
        out = {}
        for idx in range(self.module._local_start, self.module._local_stop):
            layer = newest.layers[str(idx)].layer
            if layer is None:
                continue
            sd = layer.state_dict(keep_vars=True)
            out[idx] = {k: (by_id[id(v)] if id(v) in by_id else v).detach().clone()
                        if torch.is_tensor(v) else v for k, v in sd.items()}
        return out

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True,
                        exclude_frozen_parameters=False):
        """Collective. Writes DeepSpeed's layout (see the module docstring); returns True."""
        if not save_dir:
            raise ValueError(f"save_dir must be a non-empty string, got {save_dir!r}")
        reserved = set(client_state) & set(STATE_KEYS)
        if reserved:
            raise KeyError(f"client_state uses reserved checkpoint key {sorted(reserved)[0]!r}")
        tag = str(tag if tag is not None else f"global_step{self.global_steps}")
        path = os.path.join(save_dir, tag)
        if self.global_rank == 0:
            os.makedirs(path, exist_ok=True)
        dist.barrier()
        if self.grid.get_data_parallel_rank() == 0:
            for idx, sd in self._layer_state_dicts().items():
                torch.save(sd, os.path.join(path, self.module.ckpt_layer_name(idx)))
            w = self._engine.weights
            state = {"module": None, "buffer_names": [], "optimizer": None,
                     "lr_scheduler": {"last_batch_iteration": self.global_steps - 1},
                     "global_steps": self.global_steps, "global_samples": self.global_samples,
                     "skipped_steps": self.skipped_steps, "dp_world_size": self.dp_world_size,
                     "mp_world_size": self.mp_world_size, "ds_config": self._config,
                     "ds_version": "megatron_2bw",
                     "megatron_2bw": {"engine": self._engine.state_dict(),
                                      "shapes": [tuple(s) for s in w.shapes],
                                      "parts": list(self.module.parts),
                                      "num_stages": self.num_stages, "stage": self.stage_id}}
            state.update(client_state)
            torch.save(state, self._state_file(path))
        dist.barrier()
        if save_latest and self.global_rank == 0:
            with open(os.path.join(save_dir, "latest"), "w") as f:
                f.write(tag)
        dist.barrier()
        return True

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True,
                        load_optimizer_states=True, load_lr_scheduler_states=True,
                        load_module_only=False, custom_load_fn=None):
        """Collective. Returns (path of this stage's state file, client_state), or (None, None)
        when there is no checkpoint. Weights come from the per-layer files (any stage count);
        the engine state loads directly when the layout matches, else it is re-sharded by name."""
        if tag is None:
            latest = os.path.join(load_dir, "latest")
            if not os.path.isfile(latest):
                if self.global_rank == 0:
                    print(f"warning: no 'latest' file in {load_dir}: no checkpoint loaded",
                          flush=True)
                return None, None
            with open(latest) as f:
                tag = f.read().strip()
        path = os.path.join(load_dir, str(tag))
        if not os.path.isdir(path):
            raise FileNotFoundError(f"checkpoint directory {path} does not exist")
        eng, w = self._engine, self._engine.weights
        state = eng.state_dict()
        names = list(state["names"])
        index = {n: i for i, n in enumerate(names)}
        offsets = w.offsets
        newest = state["newest"].clone()
        buffers = self._load_layer_files(path, newest, index, offsets, load_module_strict)
        state["newest"] = newest
        state_file = self._state_file(path)
        meta = torch.load(state_file, map_location="cpu", weights_only=False) \
            if os.path.isfile(state_file) else {}
        ours = meta.get("megatron_2bw")
        client = {k: v for k, v in meta.items() if k not in STATE_KEYS}
        if load_module_only:
            state.pop("previous", None)
            client = {}
        elif ours is None:  # weights only (e.g. a checkpoint written by DeepSpeed itself)
            state.pop("previous", None)
            state["iteration"] = int(meta.get("global_steps", state["iteration"]))
        elif ours["engine"]["names"] == names and \
                [tuple(s) for s in ours["shapes"]] == [tuple(s) for s in w.shapes]:
            loaded = ours["engine"]
            if not load_optimizer_states:
                loaded = {**loaded, "optimizer": state["optimizer"]}
            state = loaded
        else:
            state = self._reshard(path, state, names, load_optimizer_states)
        device = w.slots[0].device
        state = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in state.items()}
        eng.load_state_dict(state)
        for replica in w.modules:
            for idx, bufs in buffers.items():
                layer = replica.layers[str(idx)].layer
                for name, value in bufs.items():
                    _get_tensor(layer, name).copy_(value)
        if not load_module_only:
            self.global_samples = int(meta.get("global_samples",
                                               self.global_steps * self.train_batch_size()))
        self.module.adopt(eng.module)
        dist.barrier()
        return state_file, client

    def _layer_file(self, path: str, idx: int) -> str | None:
        keys = [idx]
        entry = self.module._entries.get(idx)
        if entry and entry[0] == "tied":  # DeepSpeed skips tied layers that use forward_fn
            keys += [j for j in self.module._tie_layers[entry[1]] if j != idx]
        for j in keys:
            exact = os.path.join(path, self.module.ckpt_layer_name(j))
            if os.path.isfile(exact):
                return exact
            found = sorted(glob.glob(os.path.join(path, f"layer_{j:02d}-*model_states.pt")))
            if found:
                return found[0]
        return None

    def _load_layer_files(self, path, newest, index, offsets, strict) -> dict[int, dict]:
        """Copy every local layer's saved weights into `newest` (fp32 flat); returns buffers."""
        eng = self._engine
        buffers = {}
        for idx in range(self.module._local_start, self.module._local_stop):
            layer = eng.module.layers[str(idx)].layer
            if layer is None or not layer.state_dict():
                continue
            file = self._layer_file(path, idx)
            if file is None:
                raise FileNotFoundError(f"checkpoint {path} has no file for layer {idx} "
                                        f"({self.module.layer_type_name(idx)})")
            sd = torch.load(file, map_location="cpu", weights_only=False)
            expected = layer.state_dict()
            if strict and set(sd) != set(expected):
                diff = sorted(set(sd) ^ set(expected))
                raise RuntimeError(f"layer {idx} in {file}: state dict keys differ ({diff[:3]})")
            param_names = {n for n, _ in layer.named_parameters()}
            for k, v in sd.items():
                name = f"layers.{idx}.layer.{k}"
                if k in param_names:
                    if name in index:
                        i = index[name]
                        shape = eng.weights.shapes[i]
                        if tuple(v.shape) != tuple(shape):
                            raise RuntimeError(f"layer {idx} {k}: the checkpoint's shape "
                                               f"{tuple(v.shape)} != the model's {tuple(shape)}")
                        newest[offsets[i]:offsets[i] + shape.numel()] = v.reshape(-1).to(newest)
                elif torch.is_tensor(v) and k in expected:
                    buffers.setdefault(idx, {})[k] = v
        return buffers

    def _aliases(self, name: str) -> list[str]:
        """The same tied parameter under the other layer indices of its key."""
        m = re.match(r"layers\.(\d+)\.(.*)", name)
        out = [name]
        if m:
            idx, rest = int(m.group(1)), m.group(2)
            spec = self.module._layer_specs[idx]
            key = getattr(spec, "key", None)
            if key is not None:
                out += [f"layers.{j}.{rest}" for j in self.module._tie_layers.get(key, [])
                        if j != idx]
        return out

    def _reshard(self, path: str, state: dict, names: list[str], load_optimizer: bool) -> dict:
        """Engine state for this stage's layout from all stage files of another layout."""
        sources = []  # (name -> (file state, offset, numel))
        for file in sorted(glob.glob(os.path.join(path, "mp_rank_*_model_states.pt"))):
            meta = torch.load(file, map_location="cpu", weights_only=False)
            ours = meta.get("megatron_2bw")
            if ours is None:
                continue
            es, off, table = ours["engine"], 0, {}
            for n, s in zip(es["names"], ours["shapes"]):
                numel = torch.Size(s).numel()
                table[n] = (off, numel)
                off += numel
            sources.append((es, table, off))
        if not sources:
            raise FileNotFoundError(f"no megatron_2bw stage state in {path}")

        def locate(name):
            for alias in self._aliases(name):
                for es, table, total in sources:
                    if alias in table:
                        return es, table[alias], total
            raise KeyError(f"parameter {name} is in no stage file of {path}")

        def assemble(get_flat, like):
            out = like.clone()
            pos = 0
            for n in names:
                es, (off, numel), total = locate(n)
                out[pos:pos + numel] = get_flat(es, total)[off:off + numel]
                pos += numel
            return out

        first = sources[0][0]
        new = dict(state)
        new["iteration"], new["skipped"] = first["iteration"], first["skipped"]
        new["scaler"] = first["scaler"]
        if "previous" in state:
            new["previous"] = assemble(lambda es, t: es.get("previous", es["newest"]),
                                       state["previous"])
        if load_optimizer:
            opt = dict(state["optimizer"])
            for k, v in opt.items():
                if torch.is_tensor(v) and v.dim() == 1 and v.numel() == state["newest"].numel():
                    opt[k] = assemble(lambda es, t, k=k: es["optimizer"][k], v)
                elif not torch.is_tensor(v):
                    opt[k] = first["optimizer"].get(k, v)
            new["optimizer"] = opt
        return new


def _as_iterator(data):
    """An iterator over `data` (DataLoaders and lists are accepted, like iterators)."""
    if data is None or hasattr(data, "__next__"):
        return data
    return iter(data)


def _get_tensor(module, dotted: str):
    obj = module
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj
