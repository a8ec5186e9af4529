"""`DeepSpeedPipelineEngine`: DeepSpeed's PipelineEngine contract (train_batch, eval_batch, data
iterators, queries) over megatron_2bw.pipeline.engine.PipelineEngine; checkpoints come from
checkpoint.py, the optimizer / scheduler / grid views from views.py.

Contract differences that come from 2BW itself: the engine pulls the first microbatches of batch
t+1 while it finishes batch t, so `train_batch` wants one long iterator (e.g. RepeatingLoader),
not an exactly-sized one per call (flush and gpipe read exactly m per call, like DeepSpeed); and
`engine.module` shows the newest of the two weight versions (a view that asks the engine on every
access: deepspeed/pipe/engine_view.py). Randomness is DeepSpeed's: dropout draws from each
process's own generator (seeded by the script, e.g. set_random_seed) in forward order, with no
per-microbatch reseeding (the pretrain scripts' engine reseeds by seed, stage and microbatch).

This is a view over the core engine's public surface (`pipeline/engine.py`): it assigns nothing
inside it; DeepSpeed's lr arithmetic (skipped steps do not advance the scheduler) is the
`lr_schedule` it passes to the engine's constructor, and the grid comes from the builder the
training loop uses (`ProcessGrid.from_config`).
`tests/distributed/test_deepspeed_surface.py` checks this.
"""
from __future__ import annotations

import os
import time

import torch

from megatron_2bw.config.launcher_env import env_rank_world
from megatron_2bw.deepspeed.checkpoint import CheckpointMixin
from megatron_2bw.deepspeed.pipe.module import PipelineError, PipelineModule
from megatron_2bw.deepspeed.utils import RepeatingLoader
from megatron_2bw.deepspeed.monitor import Monitor
from megatron_2bw.deepspeed.views import MPU, LRSchedulerView, OptimizerView
from megatron_2bw.parallel.comm import Comm
from megatron_2bw.parallel.devices import default_device
from megatron_2bw.parallel.distributed import current_rank_world
from megatron_2bw.parallel.grid import ProcessGrid
from megatron_2bw.schedule.kinds import ScheduleKind


def _as_iterator(data):
    """An iterator over `data` (DataLoaders and lists are accepted, like iterators)."""
    if data is None or hasattr(data, "__next__"):
        return data
    return iter(data)


class _Feed:
    """The engine's data iterator: pulls (inputs, labels) from the current source, applies the
    batch function, and turns running dry into a one-line explanation."""

    def __init__(self, source, engine, what: str, kind: ScheduleKind):
        self.source, self.engine, self.what, self.kind = source, engine, what, kind

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
            kind = self.kind
            extra = (f" {kind.name} reads the first microbatches of the next batch ahead: pass "
                     "one long iterator such as deepspeed.utils.RepeatingLoader to every call, "
                     "or use \"pipeline\": {\"schedule\": \"flush\"}"
                     if self.what == "train_batch" and not kind.flushes else "")
            raise RuntimeError(f"{self.what}: the data iterator ran out.{extra}") from None
        if self.engine.batch_fn is not None:
            batch = self.engine.batch_fn(batch)
        inputs, labels = batch[0], batch[1]
        if isinstance(inputs, list):
            inputs = tuple(inputs)
        return inputs, labels


class DeepSpeedPipelineEngine(CheckpointMixin):
    """DeepSpeed's PipelineEngine contract over megatron_2bw.pipeline.engine.PipelineEngine."""

    def __init__(self, module: PipelineModule, cfg, ds_json: dict, settings,
                 training_data=None, collate_fn=None):
        """`cfg` and `settings` (config.ds_json.DeepSpeedSettings) from config_from_deepspeed."""
        from megatron_2bw.pipeline.engine import PipelineEngine
        self._cfg, self._config, self._settings = cfg, ds_json, settings
        self.module = module
        self.global_rank, self.world_size = current_rank_world()
        self.local_rank = int(os.environ.get("LOCAL_RANK", env_rank_world()[2]))
        comm = Comm()
        self.device = default_device(self.local_rank, comm.backend)
        grid = ProcessGrid.from_config(cfg, self.global_rank, self.world_size).init_groups(
            Comm(self.device, comm.backend))
        if grid.stage != module.stage_id:
            raise RuntimeError(f"rank {self.global_rank}: grid stage {grid.stage} != module stage "
                               f"{module.stage_id}")
        self.grid = MPU(grid)
        self._sync_initial_weights(grid)
        self._compute_loss, self._capture = True, None
        self._engine = PipelineEngine(cfg, grid, module.engine_specs(), self._loss, module.parts,
                                      self.device, lr_schedule=self._lr_schedule(),
                                      dynamic_shape=module.dynamic_shape,
                                      seed_microbatches=False)   # DeepSpeed's RNG (see the top)
        module.attach_engine(self.grid, lambda: self._engine.module)
        self.num_stages, self.stage_id = grid.pipeline, grid.stage
        self.micro_batch_size = cfg.batch.micro_batch_size
        self.micro_batches = cfg.num_microbatches
        self.dp_world_size, self.mp_world_size = grid.data, grid.tensor
        self.global_samples = 0
        self.agg_train_loss = None
        self.data_iterator = None
        self.batch_fn = None
        self.training_dataloader = None
        self.optimizer = OptimizerView(self._engine.optimizer, cfg.optimizer, self.get_lr,
                                       lambda: self.module.parameters())
        self.lr_scheduler = LRSchedulerView(self) if settings.lr_schedule is not None else None
        self._feed = _Feed(lambda: self.data_iterator, self, "train_batch", self._engine.kind)
        self._timer = time.perf_counter()
        self.monitor = Monitor(ds_json, cfg, self.global_rank)
        if training_data is not None:
            self._build_data_iter(training_data, collate_fn)

    def _lr_schedule(self):
        """The JSON's scheduler with DeepSpeed's arithmetic: a skipped (fp16 overflow) step does
        not advance it, so step t uses the schedule at t - skipped; None: the Config's."""
        schedule = self._settings.lr_schedule
        if schedule is None:
            return None
        return lambda t: schedule(t - self.skipped_steps)

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
                    grid.comm.broadcast(p.data, src, tied_group)
        dp_group = grid.group("dp")
        if dp_group is not None:
            tp, pp, _ = grid.coords()
            src = grid.rank_of(tp, pp, 0)
            with torch.no_grad():
                for t in list(self.module.parameters()) + list(self.module.buffers()):
                    grid.comm.broadcast(t.data, src, dp_group)

    def _build_data_iter(self, dataset, collate_fn) -> None:
        from torch.utils.data import DataLoader, DistributedSampler
        sampler = DistributedSampler(dataset, num_replicas=self.dp_world_size,
                                     rank=self.grid.get_data_parallel_rank(), shuffle=False)
        loader = DataLoader(dataset, batch_size=self.micro_batch_size, sampler=sampler,
                            collate_fn=collate_fn,
                            drop_last=self._settings.dataloader_drop_last)
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
        self.global_samples += self.train_batch_size()
        self.agg_train_loss = loss
        if self.global_steps % self.steps_per_print() == 0:
            self._report(loss)
        if self.global_rank == 0 and self.monitor.enabled:   # DeepSpeed's events, every batch
            events = [("Train/Samples/train_loss", float(loss), self.global_samples),
                      ("Train/Samples/lr", self.get_lr()[0], self.global_samples)]
            self.monitor.write_events(events)
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
                timers = self._engine.timers
                print("time (ms) | " + " | ".join(f"{k}: {1000 * v:.2f}"
                                                 for k, v in sorted(timers.items())), flush=True)
        self._engine.timers.clear()

    def eval_batch(self, data_iter, return_logits=False, compute_loss=True, reduce_output="avg",
                   bcast_loss=True, num_micro_batches=None):
        """Forward-only over num_micro_batches (default: micro_batches) microbatches on the newest
        weights; leaves the in-flight 2BW state untouched. DeepSpeed's results: with a loss_fn
        and compute_loss, the mean loss (on every rank); without a loss_fn, or with
        compute_loss=False, the last stage's outputs: reduce_output="avg" their mean over the
        microbatches and data-parallel replicas, None the list of every microbatch's outputs.
        With compute_loss and bcast_loss (DeepSpeed's defaults) the averaged outputs are
        broadcast to every stage of the pipeline (as fp32, as DeepSpeed does); otherwise the
        other stages get None. return_logits adds the last microbatch's outputs."""
        reduce = reduce_output.lower() if isinstance(reduce_output, str) else reduce_output
        if reduce not in (None, "avg"):
            raise NotImplementedError(f"reduction type {reduce_output} not supported.")
        n = num_micro_batches or self.micro_batches
        data_iter = _as_iterator(data_iter)
        as_outputs = not compute_loss or self.module.loss_fn is None
        self._capture = [] if (return_logits or as_outputs) and self.is_last_stage() else None
        self._compute_loss = not as_outputs
        try:
            loss = self._engine.eval_batch(_Feed(lambda: data_iter, self, "eval_batch",
                                                 self._engine.kind), n)
        finally:
            outputs, self._capture, self._compute_loss = self._capture, None, True
        result = loss
        if as_outputs:
            result = None
            if self.is_last_stage():
                result = outputs if reduce is None else self._average(outputs, n)
            if compute_loss and bcast_loss and reduce is not None:
                result = self._from_last_stage(result)
        if self.global_rank == 0 and self.monitor.enabled and torch.is_tensor(result):
            self.monitor.write_events([("Train/Samples/eval_loss", float(result.float().mean()),
                                        self.global_samples)])
        if return_logits:
            return result, (outputs[-1] if outputs else None)
        return result

    def _average(self, outputs, n):
        """Mean over the n microbatches, then over the data-parallel replicas (DeepSpeed's
        "avg"); a tuple of outputs element by element."""
        tensors = isinstance(outputs[0], torch.Tensor)
        parts = [outputs] if tensors else list(zip(*outputs))
        reduced = [sum(p) / n for p in parts]
        group = self.grid.get_data_parallel_group()
        for t in reduced:
            if group is not None:
                self.grid.grid.comm.all_reduce(t, group)
                t.div_(self.dp_world_size)
        return reduced[0] if tensors else reduced

    def _from_last_stage(self, value):
        """The last stage's tensor (or tuple of tensors) as fp32 on every stage of this
        pipeline: shapes first (a fixed-size header), then the values."""
        group = self.grid.get_pipe_parallel_group()
        if group is None:
            return value.float() if torch.is_tensor(value) else [v.float() for v in value]
        comm, src = self.grid.grid.comm, self.grid.stage_to_global(self.num_stages - 1)
        parts = ([value] if torch.is_tensor(value) else list(value)) if value is not None else []
        if len(parts) > 8 or any(p.dim() > 8 for p in parts):
            raise PipelineError("eval_batch: at most 8 outputs of at most 8 dimensions can be "
                                "broadcast to every stage: pass bcast_loss=False")
        head = torch.zeros(1 + 8 * 9, dtype=torch.float64, device=self.device)
        if self.is_last_stage():   # slot 0: -1 for one tensor, else the tuple's length
            head[0] = -1 if torch.is_tensor(value) else len(parts)
            for i, p in enumerate(parts):
                head[1 + 9 * i] = p.dim()
                head[2 + 9 * i:2 + 9 * i + p.dim()] = torch.tensor(p.shape, dtype=torch.float64)
        comm.broadcast(head, src, group)
        single, out = int(head[0]) == -1, []
        for i in range(1 if single else int(head[0])):
            dims = int(head[1 + 9 * i])
            shape = [int(x) for x in head[2 + 9 * i:2 + 9 * i + dims]]
            t = (parts[i].detach().float().clone() if self.is_last_stage()
                 else torch.zeros(shape, dtype=torch.float32, device=self.device))
            comm.broadcast(t, src, group)
            out.append(t)
        return out[0] if single else out

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
        return [self._engine.lr]

    def get_global_grad_norm(self):
        return float(self._engine.last_grad_norm)

    def parameters(self, recurse=True):
        """This stage's parameters (the module's view of the newest weights)."""
        return self.module.parameters(recurse)

    def named_parameters(self, *a, **k):
        return self.module.named_parameters(*a, **k)

    def loss_scale(self):
        """DeepSpeed's meaning: the fp16 section's static loss_scale (0: dynamic)."""
        return (self._config.get("fp16") or {}).get("loss_scale", 0)

    def zero_optimization_stage(self):
        return int((self._config.get("zero_optimization") or {}).get("stage", 0))

    @property
    def config(self) -> dict:
        """The DeepSpeed config as a dict (DeepSpeed: the config argument of initialize)."""
        return self._config

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

    __call__ = backward = step = forward
