"""The batch-level actions of a stage: R (reduce), N (norm), S (step).

R(t)  mark this rank's raised control flags in the buffer's tail (flags.py), scale the batch's fp32
      gradient buffer by 1/w and start, asynchronously, the data-parallel all-reduce in buckets
      (the whole buffer but the tied slice, tail included) and the tied-weight all-reduce (first
      and last stage of every replica; the tied gradient is summed across the two stages and
      averaged across replicas in one collective).
N(t)  wait for the data-parallel reduction (and, on the first stage, the tied one), compute this
      stage's share of the squared global gradient norm, and start the model-parallel all-reduce of
      [norm^2, loss, *flags, *stage_nonfinite] (the last stage contributes the loss, so every rank
      learns it; the flag slots end as world-wide sums; slot s of the d stage slots is 1 on the
      ranks of stage s whose share of the norm is not finite: flags.py, "Numerics").
S(t)  wait for everything, hand [loss, *flags, *stage bits] to the host without blocking, clip
      by the global norm, unscale (fp16), step the optimizer from the version the schedule names
      into the slot it names (through the master when there is one), let the 2BW compensation
      write what the slot's next batch runs on (compensation.py), zero the buffer.

Every collective goes through the grid's Comm (parallel/comm.py). Nothing here synchronizes with
the host except fp16's overflow check (one read per batch). A skipped fp16 step is counted; more
than the config's skip limit in a row (a diverged run, not a loss scale still settling) ends the
run with a NumericsError on every rank alike.
"""
from __future__ import annotations

import torch

from ..config import Config
from ..optim import LRSchedule, make_loss_scaler, make_optimizer
from ..parallel.grid import ProcessGrid
from ..reliability import NumericsError, describe
from .compensation import Compensator
from .flags import ControlFlags
from .weights import VersionedWeights

BUCKET_ELEMENTS = 2 ** 24  # 64 MB of fp32 per all-reduce call


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
        self.optimizer = make_optimizer(cfg.optimizer, weights.numel, weights.decay_end, device)
        self.scaler = make_loss_scaler(cfg.precision)
        self.lr = lr_schedule or LRSchedule(cfg.optimizer, cfg.train.train_iters)
        self.compensation = Compensator(cfg.compensation, self.optimizer, weights, self.lr)
        self.cross_stage_tied = grid.pipeline > 1 and weights.tied_end > 0
        self.pending: dict[int, dict] = {}
        self.skipped = 0
        self.skipped_in_a_row = 0
        self.skip_limit = cfg.precision.skip_limit()
        self.last_loss = torch.zeros((), device=device)
        self.last_grad_norm = torch.zeros((), device=device)
        self.last_lr = 0.0

    # -- R --------------------------------------------------------------------------------------
    def reduce(self, batch: int, slot: int) -> None:
        buf = self.w.grads[slot]
        works = {"dp": [], "tied": []}
        self.flags.write(buf[self.w.numel + 1:])
        if self.dp_size > 1:
            buf.mul_(1.0 / self.dp_size)
        start = self.w.tied_end if self.cross_stage_tied else 0
        dp_group = self.grid.group("dp")
        if dp_group is not None:
            for lo in range(start, buf.numel(), BUCKET_ELEMENTS):
                chunk = buf[lo:lo + BUCKET_ELEMENTS]
                works["dp"].append(self.comm.all_reduce(chunk, dp_group, async_op=True))
        if self.cross_stage_tied:
            works["tied"].append(self.comm.all_reduce(buf[:self.w.tied_end],
                                                      self.grid.group("tied"), async_op=True))
        self.pending[batch] = works

    # -- N --------------------------------------------------------------------------------------
    def norm(self, batch: int, slot: int) -> None:
        works = self.pending[batch]
        _wait(works.pop("dp"), "data-parallel gradient all-reduce (same stage, other replicas)")
        if self.grid.is_first_stage:
            _wait(works.pop("tied"), "tied-embedding all-reduce (first and last stage)")
        buf, n = self.w.grads[slot], self.w.numel
        norm_sq = self._norm_sq(buf)
        nonfinite = self._stage_slot * torch.isfinite(norm_sq).logical_not()  # no host sync
        stats = torch.cat([norm_sq.reshape(1), buf[n:], nonfinite])  # norm^2, loss, *flags, *bits
        if self.grid.tp_rank != 0:  # tensor ranks repeat the loss; count it once
            stats[1] = 0
        group = self.grid.group("mp")
        works["stats"] = stats
        works["norm"] = [self.comm.all_reduce(stats, group, async_op=True)] if group else []

    def _norm_sq(self, buf: torch.Tensor) -> torch.Tensor:
        """This rank's share of the squared global norm: the tied gradient counts once (first
        stage), parameters replicated across tensor ranks count once (tensor rank 0)."""
        lo = self.w.tied_end if (self.cross_stage_tied and not self.grid.is_first_stage) else 0
        ranges = [(lo, self.w.numel)]
        if self.grid.tp_rank != 0:
            r0, r1 = self.w.replicated
            ranges = [(lo, max(lo, r0)), (max(lo, r1), self.w.numel)]
        total = buf.new_zeros(())
        for a, b in ranges:
            if b > a:
                total = total + buf[a:b].pow(2).sum()
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
        _wait(works.pop("tied", []), "tied-embedding all-reduce (first and last stage)")
        _wait(works.pop("norm"), "grad-norm/loss all-reduce (all stages of the replica)")
        stats = works["stats"]
        self.flags.carried(batch, stats[1:])
        scale = self.scaler.scale
        buf, n = self.w.grads[grad_slot], self.w.numel
        norm_sq, loss = stats[0], stats[1]
        grad_norm = norm_sq.sqrt() / scale
        self.last_loss, self.last_grad_norm = loss, grad_norm
        self.last_lr = lr = self.lr(batch)
        w = self.w
        if self.cfg.precision.dtype == "fp16":
            found_inf = not bool(torch.isfinite(norm_sq))  # the one host sync, fp16 only
            self.scaler.update(found_inf)
            if found_inf:
                self.skipped += 1
                self.skipped_in_a_row += 1
                self._check_skips(batch, scale)
                if w.master is not None:
                    self.compensation.publish(batch + 1, dst_slot)
                elif dst_slot != src_slot:
                    w.slots[dst_slot].copy_(w.slots[src_slot])
                buf.zero_()
                return
            self.skipped_in_a_row = 0
        grad = buf[:n]
        clip = self.cfg.optimizer.clip_grad
        if clip > 0:
            coef = torch.clamp(clip / (grad_norm + 1e-6), max=1.0)
            grad.mul_(coef / scale if scale != 1.0 else coef)
        elif scale != 1.0:
            grad.mul_(1.0 / scale)
        dst = w.slots[dst_slot]
        if w.master is not None:
            self.optimizer.step(w.master, grad, w.master, lr)
        else:
            src = dst if src_slot == dst_slot else w.slots[src_slot]
            self.optimizer.step(src, grad, dst, lr)
        self.compensation.after_step(batch, grad, dst_slot)
        buf.zero_()

    def _check_skips(self, batch: int, scale: float) -> None:
        if self.skip_limit and self.skipped_in_a_row > self.skip_limit:
            raise NumericsError(
                f"fp16 skipped {self.skipped_in_a_row} steps in a row (gradients not finite at "
                f"iterations {batch + 2 - self.skipped_in_a_row}-{batch + 1}, loss scale "
                f"{scale:g}) on {describe(self.grid)}: the run diverged; lower --lr or add "
                "--clip-grad and resume from the last checkpoint (--max-skipped-steps sets the "
                "limit, 0 disables it)")


def _wait(works, what: str = "collective") -> None:
    try:
        for work in works:
            work.wait()
    except RuntimeError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise RuntimeError(f"{what} failed: a rank of that group died or timed out ({first})"
                           ) from e
