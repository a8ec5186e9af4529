"""The batch-level actions of a stage: R (reduce), N (norm), S (step).

R(t)  mark this rank's raised control flags in the buffer's tail (flags.py); under
      --sequence-parallel first sum the sequence-parallel parameters' partial gradients over the
      tensor group; scale the batch's fp32 gradient buffer by 1/w and start, asynchronously, the
      data-parallel reduction and the tied-weight all-reduce (first and last stage of every
      replica; the tied gradient is summed across the two stages and averaged across replicas in
      one collective). The data-parallel reduction is an all-reduce of the whole buffer but the
      tied slice, tail included, in buckets, or, with the distributed optimizer, one
      reduce-scatter per bucket that leaves each rank the sum over its own piece of it (the tail
      stays out of it); most buckets started already, during the batch's last backward
      (grad_reduce.py): R starts the rest.
N(t)  wait for the data-parallel reduction (and, on the first stage, the tied one), compute this
      stage's share of the squared global gradient norm (distributed: of this rank's shard), and
      start the all-reduce of [norm^2, loss, *flags, *stage_nonfinite] over the model-parallel
      group (distributed: over the world, which sums the shards' norms and the replicas' losses,
      flags and stage bits in the same collective). The last stage contributes the loss, so every
      rank learns it; the flag slots end as world-wide sums; slot s of the d stage slots is 1 on
      the ranks of stage s whose share of the norm is not finite (flags.py, "Numerics"; with the
      distributed optimizer it is > 0 when any shard of stage s is not finite).
S(t)  wait for everything, hand [loss, *flags, *stage bits] to the host without blocking, clip
      by the global norm, unscale (fp16), step the optimizer from the version the schedule names
      into the slot it names (through the master when there is one), let the 2BW compensation
      write what the slot's next batch runs on (compensation.py; on a CPU a prediction is left
      pending and done in chunks while the engine waits, the reductions' waits here included),
      zero the buffer (or the part a pending prediction does not read yet; with one gradient
      buffer, `--2bw-grad-buffers 1`, such a prediction is completed here, since the stage's
      next backward accumulates into that buffer). With
      --decoupled-lr the lr of a step (and of a prediction) is the pair (lr, decoupled lr) of
      the schedule's `rates`, which the optimizer applies per segment (optim/segments.py).
      Distributed:
      step this rank's shard (and compensate it) and start the all-gather of the new weights (or
      their prediction) into that slot; the engine waits for it (`wait_weights`) right before
      the first forward that reads the slot (or anything else that reads weights: eval,
      checkpoints), so it overlaps whatever the schedule runs in between (at least the activation
      receive that precedes that forward on every stage but the first).

Every collective goes through the grid's Comm (parallel/comm.py). Nothing here synchronizes with
the host except fp16's overflow check (one read per batch). A skipped fp16 step is counted; more
than the config's skip limit in a row (a diverged run, not a loss scale still settling) ends the
run with a NumericsError on every rank alike (in 2BW the skipped step's next version is a copy of
the current one, on every rank alike).
"""
from __future__ import annotations

import torch

from megatron_2bw.config import Config
from megatron_2bw.optim import make_loss_scaler, make_optimizer
from megatron_2bw.optim.lr import LRSchedule
from megatron_2bw.optim.distributed import DistributedOptimizer
from megatron_2bw.parallel.grid import ProcessGrid
from megatron_2bw.pipeline.compensation import Compensator
from megatron_2bw.pipeline.faults import NumericsError
from megatron_2bw.pipeline.flags import ControlFlags
from megatron_2bw.pipeline.grad_reduce import GradReduction
from megatron_2bw.pipeline.weights import VersionedWeights
from megatron_2bw.schedule.compensation_methods import compensation_method

class BatchStepper:
    def __init__(self, cfg: Config, grid: ProcessGrid, weights: VersionedWeights, device,
                 lr_schedule=None):
        self.cfg, self.grid, self.w = cfg, grid, weights
        self.device = device
        self.comm = grid.comm
        self.comm.expect_device(device, "the pipeline engine")
        self.flags = ControlFlags(device, grid.pipeline)
        self._stage_slot = torch.zeros(grid.pipeline, device=device)  # one-hot: this stage
        self._stage_slot[grid.stage] = 1.0
        self.dp_size = grid.data
        self.sharded = weights.sharded
        keep_grad = compensation_method(cfg.compensation).keeps_grad
        # --decoupled-lr: the embedding and output parameters' ranges step at lr class 1
        decoupled = weights.decoupled if cfg.optimizer.decoupled_lr is not None else ()
        self.optimizer = DistributedOptimizer(cfg.optimizer, weights, device, keep_grad,
                                              decoupled) \
            if self.sharded else make_optimizer(cfg.optimizer, weights.numel, weights.decay_end,
                                                device, keep_grad=keep_grad, decoupled=decoupled)
        self.gathers: dict[int, list] = {}  # slot -> all-gathers still writing its weights
        sp_lo, sp_hi = weights.sequence_parallel_range
        self.sequence_parallel = (cfg.parallel.sequence_parallel and grid.group("tp") is not None
                                  and sp_hi > sp_lo)
        self.scaler = make_loss_scaler(cfg.precision)
        self.lr = lr_schedule or LRSchedule.of(cfg)  # Megatron's (in samples with a ramp)
        # what the optimizer steps with: the lr, or (lr, decoupled lr) (optim/lr.py `rates`)
        self.rates = self.lr
        if cfg.optimizer.decoupled_lr is not None:
            self.rates = getattr(self.lr, "rates", None)
            if self.rates is None:
                raise ValueError("--decoupled-lr follows Megatron's lr schedule (optim/lr.py), "
                                 "not the lr schedule given to the engine: drop one of them")
        self.compensation = Compensator(cfg.compensation, self.optimizer, weights, self.rates,
                                        self._gather, self.wait_weights,
                                        defer=torch.device(device).type == "cpu")
        self.cross_stage_tied = grid.pipeline > 1 and weights.tied_end > 0
        self.reduction = GradReduction(weights, grid, self.sequence_parallel,
                                       cfg.parallel.overlap_grad_reduce, cfg.num_microbatches)
        self.pending: dict[int, dict] = {}
        self.skipped = 0
        self.skipped_in_a_row = 0
        self.skip_limit = cfg.precision.skip_limit()
        self.last_loss = torch.zeros((), device=device)
        self.last_grad_norm = torch.zeros((), device=device)
        self.last_lr = 0.0
        self.last_decoupled_lr = None  # --decoupled-lr: the embedding and output layer's lr

    # -- R --------------------------------------------------------------------------------------
    def reduce(self, batch: int, slot: int) -> None:
        buf = self.w.grads[slot]
        works = {"dp": [], "tied": []}
        self.w.take_loss(slot)  # one-buffer 2BW: the batch's loss into the tail (weights.py)
        self.flags.write(buf[self.w.numel + 1:])
        if self.sequence_parallel:  # partial gradients of each tensor rank's part of the sequence
            lo, hi = self.w.sequence_parallel_range
            self.comm.all_reduce(buf[lo:hi], self.grid.group("tp"))
        works["dp"] = self.reduction.reduce(batch, buf)  # buckets (grad_reduce.py), scaled 1/w
        if self.cross_stage_tied:
            works["tied"].append(self.comm.all_reduce(buf[:self.w.tied_end],
                                                      self.grid.group("tied"), async_op=True))
        self.pending[batch] = works

    # -- N --------------------------------------------------------------------------------------
    def norm(self, batch: int, slot: int) -> None:
        works = self.pending[batch]
        _wait(works.pop("dp"), "data-parallel gradient all-reduce (same stage, other replicas)",
              grid=self.grid, kind="dp")
        if self.grid.is_first_stage:
            _wait(works.pop("tied"), "tied-embedding all-reduce (first and last stage)",
                  grid=self.grid, kind="tied")
        buf, n = self.w.grads[slot], self.w.numel
        norm_sq = self._norm_sq(buf)
        nonfinite = self._stage_slot * torch.isfinite(norm_sq).logical_not()  # no host sync
        stats = torch.cat([norm_sq.reshape(1), buf[n:], nonfinite])  # norm^2, loss, *flags, *bits
        if self.grid.tp_rank != 0:  # tensor ranks repeat the loss; count it once
            stats[1] = 0
        works["stats"] = stats
        if self.sharded:  # shards' norms and replicas' losses and flags: one world all-reduce
            works["norm"] = [self.comm.all_reduce(stats, None, async_op=True)]
        else:
            group = self.grid.group("mp")
            works["norm"] = [self.comm.all_reduce(stats, group, async_op=True)] if group else []

    def _norm_sq(self, buf: torch.Tensor) -> torch.Tensor:
        """This rank's share of the squared global norm: the tied gradient counts once (first
        stage), parameters replicated across tensor ranks count once (tensor rank 0), and with
        the distributed optimizer each element counts on the one rank whose shard holds it."""
        lo = self.w.tied_end if (self.cross_stage_tied and not self.grid.is_first_stage) else 0
        ranges = [(lo, self.w.numel)]
        if self.grid.tp_rank != 0:
            r0, r1 = self.w.replicated
            ranges = [(lo, max(lo, r0)), (max(lo, r1), self.w.numel)]
        if self.sharded:
            ranges = [(max(a, p.lo), min(b, p.hi)) for a, b in ranges for p in self.w.pieces]
        total = buf.new_zeros(())
        for a, b in ranges:
            if b > a:
                total = total + squared_norm(buf[a:b])
        return total

    def share_loss(self, local: torch.Tensor) -> torch.Tensor:
        """Mean over data-parallel replicas of a loss known on the last stage, on every rank
        (evaluation; training gets it through the reductions above)."""
        value = local.detach().float().clone().reshape(1)
        if not (self.grid.is_last_stage and self.grid.tp_rank == 0):
            value.zero_()
        if self.grid.group("dp") is not None:
            value.mul_(1.0 / self.dp_size)
            self.comm.all_reduce(value, self.grid.group("dp"))
        if self.grid.group("mp") is not None:
            self.comm.all_reduce(value, self.grid.group("mp"))
        return value[0]

    # -- S --------------------------------------------------------------------------------------
    def step(self, batch: int, grad_slot: int, src_slot: int, dst_slot: int) -> None:
        works = self.pending.pop(batch)
        idle = self.compensation.work if self.compensation.defer else None
        _wait(works.pop("tied", []), "tied-embedding all-reduce (first and last stage)", idle,
              self.grid, "tied")
        _wait(works.pop("norm"), "grad-norm/loss all-reduce (all stages of the replica)", idle,
              self.grid, None if self.sharded else "mp")
        self.compensation.finish()  # S(batch - 1)'s prediction reads what this step changes
        stats = works["stats"]
        self.flags.carried(batch, stats[1:])
        scale = self.scaler.scale
        buf, n = self.w.grads[grad_slot], self.w.numel
        norm_sq, loss = stats[0], stats[1]
        grad_norm = norm_sq.sqrt() / scale
        self.last_loss, self.last_grad_norm = loss, grad_norm
        lr = self.rates(batch)  # a float, or (lr, decoupled lr)
        self.last_lr, self.last_decoupled_lr = lr if isinstance(lr, tuple) else (lr, None)
        w = self.w
        if self.cfg.precision.dtype == "fp16":
            found_inf = not bool(torch.isfinite(norm_sq))  # the one host sync, fp16 only
            self.scaler.update(found_inf)
            if found_inf:
                self.skipped += 1
                self.skipped_in_a_row += 1
                self._check_skips(batch, scale)
                self.wait_weights(src_slot)
                if w.master is not None:  # sharded: this rank's pieces, then the all-gather
                    self.compensation.publish(batch + 1, dst_slot)
                elif dst_slot != src_slot:
                    w.slots[dst_slot].copy_(w.slots[src_slot])
                buf.zero_()
                return
            self.skipped_in_a_row = 0
        grads = [buf[p.lo:p.hi] for p in w.pieces] if self.sharded else [buf[:n]]
        clip = self.cfg.optimizer.clip_grad
        coef = None
        if clip > 0:
            coef = torch.clamp(clip / (grad_norm + 1e-6), max=1.0)
            coef = coef / scale if scale != 1.0 else coef
        elif scale != 1.0:
            coef = 1.0 / scale
        for grad in grads if coef is not None else ():
            grad.mul_(coef)
        dst = w.slots[dst_slot]
        src = dst if src_slot == dst_slot else w.slots[src_slot]
        if self.sharded:  # this rank's pieces (through its master piece when there is one)
            self.optimizer.step(src, buf, dst, lr)
        elif self.compensation.fused:  # the step writes the prediction into dst in its pass
            self.compensation.fused_step(batch, buf[:n], dst_slot, lr)
            buf.zero_()
            return
        elif w.master is not None:
            if self.compensation.keeps_grad_later:  # the pending work copies the kept gradient
                self.optimizer.step(w.master, buf[:n], w.master, lr, keep_grad=False)
            else:
                self.optimizer.step(w.master, buf[:n], w.master, lr)
        else:
            self.optimizer.step(src, buf[:n], dst, lr)
        # writes dst from the master (sharded: its pieces, then starts the all-gather); a pending
        # prediction that still reads the gradient zeroes it as it goes
        kept = self.compensation.after_step(batch, buf if self.sharded else buf[:n], dst_slot)
        if kept and w.grad_buffers < w.num_slots:  # batch + 1's backward comes next: done now
            self.compensation.finish()
        (buf[n:] if kept else buf).zero_()

    def _gather(self, slot: int) -> None:
        """Start the all-gather of every rank's new shard into `slot` (distributed optimizer):
        the tied region over the same data-parallel group as the rest."""
        flat, group = self.w.slots[slot], self.grid.group("dp")
        self.gathers[slot] = [
            self.comm.all_gather_into(flat[g.lo:g.hi], flat[p.lo:p.hi], group, async_op=True)
            for g, p in zip(self.w.layout.regions, self.w.pieces)]

    def wait_weights(self, slot: int | None = None) -> None:
        """Wait until `slot` (None: every slot) holds all of its weights: the all-gathers a
        distributed step started into it are done. Free when none is pending."""
        self.compensation.finish(slot)
        if not self.gathers:
            return
        for k in ([slot] if slot is not None else list(self.gathers)):
            _wait(self.gathers.pop(k, ()), "all-gather of the new weights (data-parallel ranks)",
                  grid=self.grid, kind="dp")

    def _check_skips(self, batch: int, scale: float) -> None:
        if self.skip_limit and self.skipped_in_a_row > self.skip_limit:
            raise NumericsError(
                f"fp16 skipped {self.skipped_in_a_row} steps in a row (gradients not finite at "
                f"iterations {batch + 2 - self.skipped_in_a_row}-{batch + 1}, loss scale "
                f"{scale:g}) on {self.grid.describe()}: the run diverged; lower --lr or add "
                "--clip-grad and resume from the last checkpoint (--max-skipped-steps sets the "
                "limit, 0 disables it)")


def squared_norm(x: torch.Tensor) -> torch.Tensor:
    """sum(x ** 2) in one pass without a temporary of x's size (inf and NaN survive it)."""
    return torch.linalg.vector_norm(x).square()


def _wait(works, what: str, idle=None, grid=None, kind: str | None = None) -> None:
    """Wait for `works`; `idle` (a callable doing one piece of pending work, False when none is
    left) runs while they are in flight. A failure is one line (a PeerError) naming the other
    ranks of `grid`'s group of `kind` (None: the world)."""
    try:
        if idle is not None:
            while not all(work.is_completed() for work in works) and idle():
                pass
        for work in works:
            work.wait()
    except RuntimeError as e:
        raise grid.peer_error(e, what, kind) from e
