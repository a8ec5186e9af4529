"""The pipeline engine: a small interpreter of one stage's schedule actions. It owns no policy.

`train_batch(data_iter)` runs the stage's next window of the schedule: the actions after the
previous optimizer step up to and including this batch's step. In 2BW a window already contains
the next batch's first forwards (there is no flush); windows are self-contained (the validator
checks it, `simulate.check_schedule`, before the engine runs any window of a schedule), so
evaluation or a checkpoint can happen between any two calls. Which weight version a batch uses and
which one a step writes is the schedule kind's rule (`schedule/kinds.py`); the engine only asks.

Data: the first stage takes inputs and the last stage takes labels from `next(data_iter)`, one
(inputs, labels) pair per forward, in microbatch order; other stages never touch the iterator.
A batch-size ramp (`Config.batch_plan`) runs one segment per m: nothing changes inside a window.

Public surface (what the training loop and the DeepSpeed adapter use; nothing else is theirs to
touch): `train_batch`, `eval_batch`, `start`, `state_dict`/`load_state_dict`, `module` (the stage
module holding the newest weights, asked on every access), `fp32_state`, `optimizer` (state_dict /
load_state_dict), `lr_schedule` (iteration -> lr, a constructor argument) and `lr` (the next
step's), `iteration`, `skipped_iterations`, `last_grad_norm`, `timers` (seconds per action kind
with --wall-clock-breakdown, --log-timers-to-tensorboard or --log-straggler; the reader clears it),
`profile_actions` (actions as profiler ranges, for --profile), `kind` (the schedule kind) and,
read-only, `weights` (the flat-buffer layout: names, shapes, offsets; read by DeepSpeed-layout
checkpoints).
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch

from megatron_2bw.config import Config
from megatron_2bw.models.stage import LayerSpec, StageModule
from megatron_2bw.optim.shard_layout import bucket_elements
from megatron_2bw.parallel.devices import to_device
from megatron_2bw.parallel.grid import ProcessGrid
from megatron_2bw.parallel.p2p import P2P
from megatron_2bw.pipeline.batch_step import BatchStepper
from megatron_2bw.pipeline.host_memory import keep_freed_memory
from megatron_2bw.pipeline.interpreter import Interpreter, comm_layout
from megatron_2bw.pipeline.timers import ActionClock
from megatron_2bw.pipeline.weights import VersionedWeights
from megatron_2bw.schedule import actions as A
from megatron_2bw.schedule.compensation_methods import compensation_method
from megatron_2bw.schedule.kinds import schedule_kind_of
from megatron_2bw.schedule.simulate import check_schedule
from megatron_2bw.schedule.tables import forward_only, make_schedule

UNBOUNDED = 10 ** 9  # batches in a segment when the caller does not say how many


class PipelineEngine(Interpreter):
    def __init__(self, cfg: Config, grid: ProcessGrid, specs: list[LayerSpec],
                 loss_fn: Callable, partition: list[int], device,
                 lr_schedule: Callable[[int], float] | None = None, *,
                 dynamic_shape: bool | str = False, seed_microbatches: bool = True):
        """`lr_schedule(iteration)` is the lr of that batch's step (default: the Config's
        Megatron schedule, `optim.LRSchedule`). Shapes may change between batches; with
        `dynamic_shape` at any microbatch; "fixed": never (schedule.actions.SHAPE_MODES).
        `seed_microbatches=False`: dropout draws from the process's generator in forward order."""
        self.cfg, self.grid, self.loss_fn, self.device = cfg, grid, loss_fn, torch.device(device)
        if self.device.type == "cpu":
            keep_freed_memory()  # no page faults for the stash at every batch (host_memory.py)
        self.stage, self.num_stages = grid.stage, grid.pipeline
        self.first, self.last = grid.is_first_stage, grid.is_last_stage
        if cfg.parallel.data not in (None, grid.data):
            raise ValueError(f"the config's data-parallel size {cfg.parallel.data} differs from "
                             f"the grid's {grid.data}: build the grid from the config")
        cfg = cfg.replace(parallel={"data": grid.data})  # the config on this grid
        self.m = self.eval_m = cfg.num_microbatches  # the segment's m (start); eval: the final
        self.plan, self._end = cfg.batch_plan, None  # every iteration's m; where the run ends
        start, end = partition[self.stage], partition[self.stage + 1]
        module = StageModule(specs, start, end, seed=cfg.train.seed,
                             recompute_method=cfg.model.recompute_method,
                             recompute_num_layers=cfg.model.recompute_num_layers)
        self.kind = schedule_kind_of(cfg.schedule, cfg.grad_buffers,  # --2bw-grad-buffers,
                                     cfg.microbatches_per_flush)  # --gpipe-microbatches-per-flush
        shards = grid.data if cfg.parallel.distributed_optimizer else 1
        self.weights = VersionedWeights(
            module, self.kind.num_slots, cfg.precision.dtype, self.device, tied=module.tied,
            shard_count=shards, shard_rank=grid.dp_rank if shards > 1 else 0,
            split_tied=grid.pipeline > 1,
            separate_master=compensation_method(cfg.compensation).separate_weights,
            grad_buffers=self.kind.grad_buffers_of(self.stage),
            grad_accumulation=cfg.precision.grad_accumulation,
            bucket=bucket_elements(cfg.parallel.grad_bucket_size, grid.data))
        self.stepper = BatchStepper(cfg, grid, self.weights, self.device, lr_schedule)
        self.p2p = P2P(grid, self.device)
        if self.stepper.compensation.defer:
            self._idle_work = self.stepper.compensation.work
        self._trackers = list({id(sp.tracker): sp.tracker for sp in specs[start:end]
                               if sp.tracker is not None}.values())
        self._seeded = module.draws_random and seed_microbatches  # no dropout: no seeding
        self.iteration, self.schedule = 0, None  # optimizer steps done == the next batch
        self._plain_handlers = {A.FORWARD: self._forward, A.BACKWARD: self._backward,
                                A.REDUCE: self._reduce, A.NORM: self._norm, A.STEP: self._step}
        self._handlers = self._plain_handlers
        self._clear_stash()
        self._clock = ActionClock(self.device)  # no host syncs: CUDA events on a GPU
        self._timed, self.shapes = cfg.train.times_actions, A.shape_mode(dynamic_shape)
        self._comm_layout = comm_layout(cfg, grid, specs, self.shapes)

    # -- public API -------------------------------------------------------------------------------
    def start(self, num_batches: int | None = None) -> None:
        """Begin a schedule segment at the current iteration (warm-up happens here once) for
        `num_batches` batches (None: to the end the last call set, else without end), or up to
        where the config's batch plan changes m (a ramp; `train_batch` starts the next)."""
        t = self.iteration
        if num_batches is not None:
            self._end = t + num_batches
        end = min(self._end if (self._end or 0) > t else t + UNBOUNDED,
                  self.plan.next_change(t) or t + UNBOUNDED)
        self.m = self.plan.m(t)
        self.schedule = make_schedule(self.kind, self.num_stages, self.m, num_batches=end - t,
                                      first_batch=t)
        self._plan_receives(self.schedule)
        self.stepper.reduction.reset(self.m)
        self.p2p.reset()
        self._clear_stash()

    def train_batch(self, data_iter: Iterator) -> torch.Tensor:
        """Run one batch; returns its loss (mean over microbatches and replicas) on every rank,
        as a device tensor (no host sync)."""
        s = self.schedule
        if s is None or self.iteration >= s.first_batch + s.num_batches:
            self.start()
        check_schedule(self.schedule)
        self.stepper.compensation.resume(self.iteration, self._newest_slot())
        self._data = data_iter
        self._run(self.schedule.window(self.stage, self.iteration), self._handlers)
        self._data = None
        return self.stepper.last_loss

    def eval_batch(self, data_iter: Iterator, num_microbatches: int | None = None
                   ) -> torch.Tensor:
        """Forward-only pass over `num_microbatches` (default: the final batch's m) on the newest
        weights, without touching in-flight 2BW state; returns the mean loss (over microbatches
        and replicas) on every rank."""
        n = num_microbatches or self.eval_m
        schedule = forward_only(self.num_stages, n)
        check_schedule(schedule)
        actions = schedule.window(self.stage, 0)
        saved = (self.inputs, self.outputs, self.act_out, self.grad_in, self.grad_out,
                 self.p2p.shape_state, self._early_receives, self._headers)
        self._plan_receives(schedule)
        self._clear_stash()
        self.p2p.reset()
        module = self.module
        self._data, self._eval = data_iter, (module, torch.zeros((), device=self.device), n)
        module.eval()
        try:
            with torch.no_grad():
                self._run(actions, {A.FORWARD: self._eval_forward})
        finally:
            module.train()
            (self.inputs, self.outputs, self.act_out, self.grad_in, self.grad_out,
             self.p2p.shape_state, self._early_receives, self._headers) = saved
            self._data = None
        return self.stepper.share_loss(self._eval[1])

    def _eval_forward(self, a: A.Action) -> None:
        module, total, n = self._eval
        labels = None
        if self.first or self.last:
            inputs, labels = self._next_data()
        x = (inputs if isinstance(inputs, tuple) else (inputs,)) if self.first \
            else self._received_inputs(a.mb)
        out = module(*x)
        if not self.first:
            self.p2p.release(self.inputs.pop(a.mb))
        if self.last:
            total.add_(self.loss_fn(out, labels).float(), alpha=1.0 / n)
        else:
            out = out if isinstance(out, tuple) else (out,)
            self.outputs[a.mb] = out  # only for the handshake's shapes; dropped with the stash
            self.act_out[a.mb] = out

    # -- checkpoint state -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything needed to continue exactly at the current iteration boundary: the newest
        weights (fp32), the version the next batch runs on (2BW: W(t-1), or its compensation's
        prediction of W(t)), optimizer and loss scaler state. In-flight microbatches of the next
        batch are not saved: a resumed run redoes them from the same data. Weights are the
        parameters back to back (no padding). With the distributed optimizer this rank's call is
        local: "optimizer" is its shard (optim/distributed.py, with the exact fp32 master of
        bf16/fp16 runs) and "newest" the newest version slot in fp32 (a compensation's prediction
        leaves it until the next batch: `show_newest`)."""
        self.stepper.compensation.show_newest(self._newest_slot())
        self.stepper.wait_weights()
        w, t, kind = self.weights, self.iteration, self.kind
        state = {"iteration": t, "schedule": self.cfg.schedule, "names": list(w.names),
                 "newest": w.pack(w.fp32_weights(self._newest_slot())).clone(),
                 "optimizer": self.stepper.optimizer.state_dict(),
                 "scaler": self.stepper.scaler.state_dict(), "skipped": self.stepper.skipped}
        if w.num_slots > 1:
            state["previous"] = w.pack(w.slots[kind.slot_of_batch(t)]).clone()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Load `state_dict()`'s form; without "optimizer" the optimizer keeps its state. The
        optimizer state may come from a run with another data-parallel size or without the
        distributed optimizer (a list of every rank's shards, or the unsharded form)."""
        w = self.weights
        if list(state["names"]) != list(w.names) or \
                state["newest"].numel() != w.layout.real_numel:
            raise ValueError("checkpoint does not match this stage's parameters (different model "
                             "shape or parallel layout)")
        self.stepper.wait_weights()
        t = int(state["iteration"])
        optimizer = state.get("optimizer")
        if optimizer is not None and not w.sharded:
            from megatron_2bw.optim.distributed import full_state
            optimizer = full_state(optimizer)
        with torch.no_grad():
            newest = w.slots[self.kind.newest_slot(t)]
            w.unpack_into(newest, state["newest"])
            if w.num_slots > 1:
                prev = state.get("previous")
                w.unpack_into(w.slots[self.kind.slot_of_batch(t)],
                              prev if prev is not None else state["newest"])
            master = optimizer.get("master") if isinstance(optimizer, dict) else None
            if w.master is not None and not w.sharded:
                w.master.copy_(master if master is not None else state["newest"])
            w.zero_grads()
        restored = self.stepper.optimizer.load_state_dict(optimizer) \
            if optimizer is not None else False
        if w.sharded and w.master is not None and not restored:
            for p, piece in zip(w.pieces, w.master_pieces()):
                lo, hi = p.global_range
                piece[:p.real].copy_(state["newest"][lo:hi])
        # what batch t+1 runs on: the master, or a compensation's prediction
        self.stepper.compensation.restore(t, self.kind.newest_slot(t))
        self.stepper.scaler.load_state_dict(state["scaler"])
        self.stepper.skipped = int(state["skipped"])
        self._clear_stash()
        self.iteration = t
        self.schedule = None  # the next train_batch starts a new segment (warm-up) at t

    @property
    def module(self) -> StageModule:
        """The stage module holding the newest weights (under 2BW's `predict` compensation its
        slot holds them until the next train_batch puts the prediction back)."""
        slot = self._newest_slot()
        self.stepper.compensation.show_newest(slot)
        self.stepper.wait_weights()
        return self.weights.modules[slot]

    def fp32_state(self) -> dict[str, torch.Tensor]:
        """Newest weights in fp32 by global parameter name (the master weights, or with the
        distributed optimizer in bf16/fp16 the newest slot: no rank holds the whole master)."""
        self.stepper.compensation.show_newest(self._newest_slot())
        self.stepper.wait_weights()
        return self.weights.named_tensors(self.weights.fp32_weights(self._newest_slot()))

    @property
    def last_grad_norm(self) -> torch.Tensor:
        return self.stepper.last_grad_norm

    def params_norm(self) -> float:
        """Collective (every rank): the L2 norm of the newest weights of the whole model, each
        element counted once as in the gradient norm (tied once, tensor-replicated once, a
        shard's elements on their rank): Megatron's --log-params-norm."""
        slot = self._newest_slot()
        self.stepper.compensation.show_newest(slot)
        self.stepper.wait_weights()
        total = self.stepper._norm_sq(self.weights.fp32_weights(slot)).reshape(1).clone()
        group = None if self.stepper.sharded else self.grid.group("mp")
        if self.stepper.sharded or group is not None:
            self.stepper.comm.all_reduce(total, group)
        return float(total.sqrt())

    @property
    def optimizer(self):
        """The optimizer over this stage's flat weights (the engine steps it in train_batch)."""
        self.stepper.compensation.finish()  # a pending prediction reads its state
        return self.stepper.optimizer

    lr_schedule = property(lambda self: self.stepper.lr)  # Callable[[int], float]

    @property
    def lr(self) -> float:
        """The lr of the next optimizer step (batch `iteration`)."""
        return float(self.stepper.lr(self.iteration))

    skipped_iterations = property(lambda self: self.stepper.skipped)

    # -- interpreter (the loop and the communication groups: interpreter.py) ---------------------
    @property
    def timers(self) -> ActionClock:
        """Seconds per kind of action (forward, backward, p2p, all-reduce, optimizer) since the
        last `timers.clear()`, when `cfg.train.times_actions`; reading waits for the device once."""
        return self._clock

    @property
    def trace(self) -> list | None:
        """[(actions, start, end)] (seconds since the epoch) since enable_trace(), else None."""
        return self._clock.events()

    def enable_trace(self) -> None:
        """Record (actions, start, end) of every action or communication group from now on."""
        self._clock.trace()

    def save_trace(self, path: str) -> None:
        """Write this rank's trace as JSON: {"stage", "rank", "schedule", "events": [...]}."""
        import json
        from megatron_2bw.fs import atomic_write_text
        atomic_write_text(path, json.dumps({
            "stage": self.stage, "rank": self.grid.rank, "dp": self.grid.dp_rank,
            "tp": self.grid.tp_rank, "schedule": self.cfg.schedule,
            "num_stages": self.num_stages, "events": self.trace or []}))

    def profile_actions(self, on: bool) -> None:
        """Name every action a `torch.profiler` range (on) or stop (off; the default, and free):
        F3v0, B3v0, R2, N2, S2 and p2p groups as "sa3 rg1" (the --trace labels), so a profile's
        kernels appear inside the action that launched them. Wraps the dispatch targets; `_run`
        itself is unchanged."""
        self.__dict__.pop("_communicate", None)  # the method again
        self._handlers = self._plain_handlers
        if on:
            from torch.profiler import record_function

            def ranged(fn, label):
                def run(arg, *rest):  # _communicate(group, ahead): labelled by its group
                    with record_function(label(arg)):
                        fn(arg, *rest)
                return run
            self._handlers = {k: ranged(fn, str) for k, fn in self._plain_handlers.items()}
            self._communicate = ranged(self._communicate,
                                       lambda group: " ".join(map(str, group)))

    def _newest_slot(self) -> int:
        """Slot of W(iteration)."""
        return self.kind.newest_slot(self.iteration)

    def _next_data(self):
        try:
            inputs, labels = next(self._data)
        except StopIteration:
            raise RuntimeError(f"data iterator ran out at iteration {self.iteration}: give "
                               "train_batch an iterator with enough microbatches") from None
        return to_device(inputs, self.device), to_device(labels, self.device)

    def _seed_microbatch(self, mb: int) -> None:
        """Dropout randomness is a function of (seed, stage, microbatch) only, so a forward gives
        the same masks whenever it runs: after a resume, with any schedule, on any layout."""
        seed = (self.cfg.train.seed * 1_000_003 + self.stage * 7919 + mb) % (2 ** 62)
        torch.default_generator.manual_seed(seed)  # torch.manual_seed costs ~0.2 ms (lazy seeds)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)
        for tracker in self._trackers:
            tracker.reseed(seed)

    def _forward(self, a: A.Action) -> None:
        self.stepper.wait_weights(a.version)  # a distributed step's all-gather into this slot
        if self._seeded:
            self._seed_microbatch(a.mb)
        module = self.weights.modules[a.version]
        labels = None
        if self.first or self.last:
            inputs, labels = self._next_data()
        x = (inputs if isinstance(inputs, tuple) else (inputs,)) if self.first \
            else self._received_inputs(a.mb)
        out = module(*x)
        if self.last:
            loss = self.loss_fn(out, labels)
            self.outputs[a.mb] = loss
            batch = a.mb // self.m
            slot = self.kind.slot_of_batch(batch)  # its loss element (weights.py `losses`)
            self.weights.losses[slot].add_(loss.detach().float(), alpha=1.0 / self.m)
        else:
            out = out if isinstance(out, tuple) else (out,)
            self.outputs[a.mb] = out
            self.act_out[a.mb] = tuple(t.detach() for t in out)

    def _backward(self, a: A.Action) -> None:
        reduction = self.stepper.reduction  # the batch's last backward: buckets start in it
        reduction.before_backward(a.mb // self.m, a.version)
        out = self.outputs.pop(a.mb)
        if self.last:
            torch.autograd.backward(out * (self.stepper.scaler.scale / self.m))
        else:
            grads = self.grad_in.pop(a.mb)
            needs = [t for t in out if t.requires_grad]
            torch.autograd.backward(needs, grads)
            self.p2p.release(grads)
        if not self.first:
            x = self.inputs.pop(a.mb)
            self.grad_out[a.mb] = tuple(t.grad for t in x if t.requires_grad)
            self.p2p.release(x)
        reduction.disarm()
        self.weights.fold_model_grad(a.version)

    def _reduce(self, a: A.Action) -> None:
        self.stepper.reduce(a.batch, self.kind.slot_of_batch(a.batch))

    def _norm(self, a: A.Action) -> None:
        self.stepper.norm(a.batch, self.kind.slot_of_batch(a.batch))

    def _step(self, a: A.Action) -> None:
        k, t = self.kind, a.batch
        self.stepper.step(t, k.slot_of_batch(t), k.newest_slot(t), k.step_writes_slot(t))
        self.iteration = t + 1
