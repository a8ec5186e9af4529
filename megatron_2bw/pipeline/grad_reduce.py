"""The data-parallel gradient reduction of one stage, in buckets that start while the batch's
last backward still runs (R of batch_step.py; Megatron's overlapped gradient reduce).

Buckets are the regions of the stage's flat layout (optim/shard_layout.py) past a cross-stage
tied weight: whole parameters in layout order, at most `--ddp-bucket-size` elements each
(Megatron's default, max(40M, 1M * w)). A bucket's reduction scales it by 1/w and all-reduces it
over the data-parallel group, or, with the distributed optimizer, reduce-scatters it into this
rank's piece of it.

Early start (`ParallelConfig.overlap_grad_reduce`, on unless --no-overlap-grad-reduce). Backwards
on a stage add into the batch's fp32 buffer, so the batch's gradient of a parameter is complete
once the stage's last backward of that batch has accumulated it. Right before that backward the
engine `arm`s the reduction: a post-accumulate hook on every parameter of the slot's module
counts its bucket down, and a bucket whose parameters all have their gradient starts at once,
while the backward goes on (backward runs from the stage's last layer to its first, so buckets
fill from both ends of each class of the layout, pipeline/weights.py). `disarm` after the
backward removes the hooks: they live for one backward per batch, never per microbatch. What
R(t) starts itself, in buffer order:
- a bucket holding a sequence-parallel parameter (--sequence-parallel: its partial gradients are
  first summed over the tensor group at R);
- a bucket holding a parameter that got no gradient in that backward (an unused one);
- every bucket under --grad-accumulation buffer (the gradient reaches fp32 only after the
  backward, pipeline/weights.py) or --no-overlap-grad-reduce;
- the tail of the buffer ([loss, *flags], written at R): with the last bucket when that one
  starts at R, else one small all-reduce of its own (not under the distributed optimizer: the
  norm's all-reduce carries it, batch_step.py).
N(t) waits for every bucket (`take`).

Order: the replicas of a stage run the same graph, so their hooks fire in the same order and
every replica starts the same collectives in the same order on the data-parallel group, as
NCCL and gloo need. schedule/nccl_posts.py posts the early part at the last backward
(`CommLayout.early_reduce`); the cost model prices what the backward hides (planner/cost_model.py).
"""
from __future__ import annotations

from megatron_2bw.pipeline.weights import VersionedWeights


class GradReduction:
    def __init__(self, weights: VersionedWeights, grid, sequence_parallel: bool,
                 overlap: bool = True, microbatches: int = 1):
        self.w, self.comm, self.m = weights, grid.comm, microbatches
        self.group = grid.group("dp")
        self.dp_size = grid.data
        self.sharded = weights.sharded
        self.cross_stage_tied = grid.pipeline > 1 and weights.tied_end > 0
        start = weights.tied_end if self.cross_stage_tied else 0
        regions = [r for r in weights.layout.regions if r.lo >= start]
        pieces = [p for r, p in zip(weights.layout.regions, weights.pieces) if r.lo >= start]
        reduces = self.group is not None or self.sharded
        self.buckets = [(r.lo, r.hi, p) for r, p in zip(regions, pieces)] if reduces else []
        sp_lo, sp_hi = weights.sequence_parallel_range
        early = [not (sequence_parallel and lo < sp_hi and sp_lo < hi)
                 for lo, hi, _ in self.buckets]
        # parameter i -> the early buckets it lies in (one: buckets hold whole parameters)
        self._of_param = []
        for o, shape in zip(weights.offsets, weights.shapes):
            end = o + shape.numel()
            self._of_param.append([b for b, (lo, hi, _) in enumerate(self.buckets)
                                   if early[b] and lo < end and o < hi])
        self._params_in = [0] * len(self.buckets)
        for bs in self._of_param:
            for b in bs:
                self._params_in[b] += 1
        self.overlap = (overlap and weights.model_grad is None and
                        any(n > 0 for n in self._params_in))
        self.started: dict[int, dict] = {}  # batch -> {bucket: work} started during backward
        self._armed = None   # (batch, buffer, parameters left per bucket)
        self._handles: list = []
        self.early_buckets = 0  # buckets started inside a backward so far (tests, bench)
        self._backwards: dict[int, int] = {}  # batch -> its backwards run on this stage so far

    # -- the last backward of a batch -------------------------------------------------------------
    def reset(self, microbatches: int | None = None) -> None:
        """A new schedule segment (it starts at a batch boundary) of `microbatches` per batch
        (None: as before)."""
        self.disarm()
        self._backwards = {}
        self.m = microbatches or self.m

    def before_backward(self, batch: int, slot: int) -> None:
        """Before each backward of `batch` (into `grads[slot]`): the m-th arms the hooks."""
        done = self._backwards.pop(batch, 0) + 1
        if done < self.m:
            self._backwards[batch] = done
        elif self.overlap:
            self.arm(batch, slot)

    def arm(self, batch: int, slot: int) -> None:
        """Before the stage's last backward of `batch` (its gradient in `grads[slot]`)."""
        self.disarm()
        self._armed = (batch, self.w.grads[slot], list(self._params_in))
        self.started[batch] = {}
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(bs))
                         for p, bs in zip(self.w.params[slot], self._of_param) if bs]

    def disarm(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles, self._armed = [], None

    def _hook(self, buckets):
        def hook(_param) -> None:
            batch, buf, left = self._armed
            for b in buckets:
                left[b] -= 1
                if left[b] == 0:
                    self.started[batch][b] = self._start(buf, b)
                    self.early_buckets += 1
        return hook

    # -- R and N ----------------------------------------------------------------------------------
    def reduce(self, batch: int, buf) -> list:
        """R: start what the backward did not (buffer order), then the tail; returns every work
        of the batch's data-parallel reduction (N waits for them)."""
        started = self.started.pop(batch, {})
        n, last = self.w.numel, len(self.buckets) - 1
        # unsharded, the tail is all-reduced with the last bucket when that one starts here
        tail_rides = not self.sharded and self.buckets and last not in started
        works = [started[b] if b in started else self._start(buf, b, tail=b == last)
                 for b in range(len(self.buckets))]
        if self.dp_size > 1:
            if self.cross_stage_tied:  # the tied all-reduce averages it across replicas
                buf[:self.w.tied_end].mul_(1.0 / self.dp_size)
            if not tail_rides:
                buf[n:].mul_(1.0 / self.dp_size)
        if not self.sharded and self.buckets and not tail_rides:  # the tail on its own
            works.append(self.comm.all_reduce(buf[n:], self.group, async_op=True))
        return works

    def _start(self, buf, b: int, tail: bool = False):
        lo, hi, piece = self.buckets[b]
        if self.sharded:  # the group's rank order is the dp rank (grid.py)
            chunk = buf[lo:hi]
            chunk.mul_(1.0 / self.dp_size)
            return self.comm.reduce_scatter(buf[piece.lo:piece.hi], chunk, self.group,
                                            async_op=True)
        chunk = buf[lo:] if tail else buf[lo:hi]  # the last bucket takes the tail along
        chunk.mul_(1.0 / self.dp_size)
        return self.comm.all_reduce(chunk, self.group, async_op=True)
