"""2BW staleness compensation (`--2bw-compensation`): what a batch runs on, and how a step treats a
one-step-late gradient.

2BW (docs/ARCHITECTURE.md section 1) runs batch t forward and backward on W(t-1) and steps
W(t+1) = step(W(t), g_t). Every method acts at one moment, S(t): the step that writes into the slot
batch t+2 runs on (the kind's `step_writes_slot(t)`), while batch t+1 already runs on the other.

    none     the slot gets W(t+1); batch t+2 runs on W(t+1) (plain 2BW).
    predict  the slot gets P(t+2) = optimizer.predict(W(t+1), lr(t+1)): W(t+1) moved by the update
             the optimizer's state after S(t) implies for S(t+1), at S(t+1)'s lr (Adam: the bias-
             corrected moments with decoupled weight decay; SGD: the momentum buffer). Batch t+2
             runs forward and backward on P(t+2) ~ W(t+2), so its gradient is nearly the
             synchronous one; S(t+2) applies it to the real W(t+2), never to the prediction:
             W(t+3) = step(W(t+2), g_{t+2}(P(t+2))).
    predict-spike  Adam only: after S(t), W(t+1) first gets the spike compensation for a delay
             of one step (`optimizer.spike`: the momentum term weighs b1 * m(t+1) and the late
             gradient gets the (1 - b1) share it missed at once), then the slot gets the
             prediction made from the corrected W(t+1), as in `predict`.
    predict-nesterov  Adam only: the slot gets the Nesterov (NAdam) form of the prediction,
             `optimizer.predict(W(t+1), lr(t+1), nesterov=True)`: the latest gradient g_t (the
             one S(t) applied) stands in for the unknown next one, so the update's momentum term
             is (b1 * m(t+1) + (1 - b1) * g_t) / bias1 instead of m_hat(t+1); the real weights
             and the optimizer's trajectory stay plain Adam (unlike predict-spike). The
             optimizer keeps g_t as part of its state (`keep_grad`: "last_grad"), so the
             prediction stays a pure function of master, optimizer state and lr (views,
             checkpoints: below). A checkpoint without it (another method's, an older one)
             loads with last_grad = m, so the first prediction after such a load is `predict`'s.

Measured (bench/README.md, "2BW staleness compensation"): at the usual settings every method is
within 0.5% of GPipe (predict-spike ahead of it); at a constant lr 3e-3 predict-nesterov comes
closest, then predict-spike, then predict. The spike alone (V(t) = W(t-1)) was tried and did no
better than predict, so it is not offered.

Batches 0 and 1 run on W(0) with every method: no step has been taken to predict from. After a
skipped fp16 step, W(t+1) = W(t) and the prediction is made from the unchanged state.

Memory. The slots hold the versions the batches run on; the optimizer reads the real weights.
bf16/fp16 keep them anyway (`weights.master`, fp32): the prediction is written where the
low-precision W would have been, at no extra memory. fp32 runs have no master: `predict` adds one
stage-sized fp32 buffer for the real W (`weights.master`; `separate_weights`; 1/w of it, this
rank's shard, under the distributed optimizer), counted by the planner's memory model
(`planner.cost_model.state_bytes`) and bench/memory.py. `predict-nesterov` adds one more
stage-sized fp32 buffer, the kept gradient (`keeps_grad`; optimizer state, so 1/w of it under the
distributed optimizer), counted the same way. The native kernel needs no scratch; torch's
prediction works in chunks (`optim.optimizer.chunk_elements`: 2^18 elements on a CPU, 2^24 on an
accelerator) with two chunk-sized fp32 scratch buffers (the chunk's denominator, and the spike's
difference or the nesterov momentum term), never a transient buffer of the stage's size.

Time. Once per batch and stage, elementwise over the stage's parameters. On a CPU with the native
Adam kernel (optim/native.py, the default where a C compiler builds it; fp32 or bf16 slots, not
sharded: `fused`) the step itself writes the prediction (and the spike, and the kept gradient) in
its one pass over weights, gradient and moments: one more written stream (two with the kept
gradient), 4% / 6% / 29% more than plain 2BW's step (predict / predict-spike / predict-nesterov;
bench/step_kernels.py), nothing left for later. With torch's kernels (no compiler, fp16 slots;
optim/optimizer.py, `predict_chunks`) Adam `predict` takes about 1.7x the fused Adam step, the
spike one pass over the gradient more, the nesterov form one pass more plus the copy of the
gradient it keeps, and on a CPU (`defer`, not sharded) the engine does not pay it in the step: S(t)
leaves the prediction pending (with predict-nesterov also the copy of g_t into the optimizer's
last_grad, `keeps_grad_later`) and the engine runs its chunks while it waits for a peer (a receive
in interpreter.py, the reductions before the next step in batch_step.py), completing what is left
(`finish`) right before the first forward that reads the slot, the next step, any view, checkpoint
or load, or a reader of the optimizer; under predict-spike and predict-nesterov the pending work
also owns batch t's gradient and zeroes each chunk of it when done (the buffer is next written by
batch t + 2's backward). The order of the chunks never changes a bit. What that hides is bounded:
2BW has no bubble, so in its steady state a stage waits only for its peers' latency, and the rest
of the work lengthens the waits (bench/README.md, "2BW staleness compensation", measures it with
bench/peers.py). Under the distributed optimizer the prediction is made in the step (its all-gather
is a collective: every rank must start it at the same point of the schedule), as on an accelerator,
whose kernels queue behind the step's anyway.

Views. Between two batches the newest slot holds P(t+1), not W(t). `show_newest` writes W(t) there
for evaluation and for whoever asks the engine for its newest module; `resume` writes the
prediction back before the next batch runs: bitwise the same, since it is a pure function of
master, optimizer state and lr. Checkpoints save the master as the newest weights and the slot of
the next batch (its prediction) as the previous version; loading recomputes the newest slot's.

Distributed optimizer (`--use-distributed-optimizer`, optim/distributed.py: master and optimizer
state sharded over the w data-parallel ranks). The prediction (and the spike) is elementwise, so
each rank computes it on its shard's pieces (master piece -> slot piece, the distributed
optimizer's `predict`) and `gather` all-gathers the pieces into the slot, as after a plain sharded
step: `publish` (every step, a resume, a load) starts it, and the engine waits for it before the
slot's first forward. `show_newest` copies the master pieces and gathers at once, so under a
sharding distributed optimizer it is a collective of the stage's data-parallel group: evaluation,
checkpoints (`state_dict`, `fp32_state`) and `engine.module` must be asked on all its ranks
together, as they are by training, evaluation and checkpointing.
"""
from __future__ import annotations

from megatron_2bw.schedule.compensation_methods import compensation_method


class Compensator:
    """The engine's side: called by BatchStepper after every step, and by the engine around
    views of the newest weights. `lr(t)` is the lr of S(t) (with --decoupled-lr the pair (lr,
    decoupled lr) of the schedule's `rates`: the prediction and the spike move the embedding and
    output parameters at theirs, as the steps do); `gather(slot)` starts the all-gather
    of every data-parallel rank's pieces into `slot` and `wait(slot)` waits for it (sharded
    weights only: the distributed optimizer). `defer` (the engine passes it on a CPU): a
    prediction is left pending after the step and done in chunks by `work`, which the engine
    calls while it waits for its peers, and completed by `finish` before anything reads what it
    writes (see "Time" in the module docstring)."""

    def __init__(self, name: str, optimizer, weights, lr, gather=None, wait=None,
                 defer: bool = False):
        self.method = compensation_method(name)
        self.optimizer, self.w, self.lr = optimizer, weights, lr
        self.gather, self.wait = gather, wait
        if self.method.separate_weights and weights.master is None:
            raise ValueError(f"--2bw-compensation {name} needs the weights apart from the slots: "
                             "build VersionedWeights with separate_master=True")
        if weights.sharded and (gather is None or wait is None):
            raise ValueError("sharded weights (distributed optimizer) need the Compensator's "
                             "gather and wait")
        # the step writes the prediction in its own pass (the native CPU kernel): nothing left
        self.fused = (self.method.predicts and not weights.sharded and weights.master is not None
                      and optimizer.fuses_prediction(weights.slots[0].dtype))
        # sharded: the all-gather after it is a collective, whose order must not depend on
        # how long a rank waited
        self.defer = defer and self.method.predicts and not weights.sharded and not self.fused
        self.job = self.job_slot = self.job_grad = None  # the pending prediction
        self.chunks = self.chunks_in_waits = 0  # deferred chunks done, of them in waits (`work`)
        self.showing = False

    @property
    def keeps_grad_later(self) -> bool:
        """The optimizer's copy of the gradient it keeps is left to the pending work."""
        return self.defer and self.method.keeps_grad

    def fused_step(self, batch: int, grad, dst_slot: int, lr: float) -> None:
        """`fused` only: S(batch) from the master into the master with `grad` at `lr`, writing
        what batch + 2 runs on into `dst_slot` in the same pass (what `after_step` would)."""
        self.finish()
        self.showing = False
        m = self.method
        self.optimizer.step(self.w.master, grad, self.w.master, lr,
                            predict=(self.w.slots[dst_slot], self.lr(batch + 1), m.nesterov,
                                     m.spikes))

    def after_step(self, batch: int, grad, dst_slot: int) -> bool:
        """S(batch) has written W(batch+1) (into the master, or into slot `dst_slot` without one;
        sharded: this rank's pieces) with `grad`: compensate, then publish what batch + 2 runs on
        into `dst_slot` (`keeps_grad_later`: the step left the optimizer's copy of `grad` to
        this). Returns whether the pending work still reads `grad` (predict-spike, or the copy;
        deferred): then it zeroes each chunk of `grad` when done with it, else the caller zeroes
        it."""
        spike = (grad, self.lr(batch)) if self.method.spikes else None
        fresh = grad if self.keeps_grad_later else None
        self.publish(batch + 1, dst_slot, spike, fresh)
        if self.job is not None and (spike is not None or fresh is not None):
            self.job_grad = grad
            return True
        return False

    def publish(self, t: int, slot: int, spike: tuple | None = None, fresh=None) -> None:
        """From W(t) in the master (`spike`: corrected first): write what batch t + 1 runs on
        into `slot` (`fresh`: the step's gradient, for the optimizer to keep as it goes; fp32
        runs without a master: the step wrote W(t) there already); sharded:
        this rank's pieces, then start the all-gather of the rest. Deferred: left pending."""
        w = self.w
        self.finish()
        self.showing = False
        if w.sharded:
            self.wait(slot)  # an all-gather still writing the slot (after a load, a view)
        if w.master is not None:
            if self.defer:
                self.job = self.optimizer.predict_chunks(w.master, w.slots[slot], self.lr(t),
                                                         self.method.nesterov, spike, fresh)
                self.job_slot = slot
            elif self.method.predicts:
                self.optimizer.predict(w.master, w.slots[slot], self.lr(t),
                                       nesterov=self.method.nesterov, spike=spike)
            else:
                w.master_into(slot)
        if w.sharded:
            self.gather(slot)

    def work(self) -> bool:
        """One chunk of the pending prediction, while the engine waits; whether any is left."""
        if self._chunk():
            self.chunks_in_waits += 1
            return True
        return False

    def _chunk(self) -> bool:
        if self.job is None:
            return False
        done = next(self.job, None)
        if done is None:
            self.job = self.job_slot = self.job_grad = None
            return False
        if self.job_grad is not None:
            self.job_grad[done[0]:done[1]].zero_()
        self.chunks += 1
        return True

    def finish(self, slot: int | None = None) -> None:
        """Complete the pending prediction (`slot`: only if it writes that slot) before anything
        reads the slot, the master or the gradient it uses, or changes the optimizer's state."""
        if self.job is not None and (slot is None or slot == self.job_slot):
            while self._chunk():
                pass

    def restore(self, t: int, slot: int) -> None:
        """After a checkpoint load wrote W(t) into `slot` (the newest) and the master: what batch
        t + 1 runs on. Sharded runs without a prediction already hold it: no collective."""
        if not self.w.sharded or self.method.predicts:
            self.publish(t, slot)

    def show_newest(self, slot: int) -> None:
        """Make `slot` (the newest) hold W(t) until `resume` (sharded: a collective of the
        data-parallel group, see the module docstring)."""
        self.finish()
        if self.method.predicts and not self.showing:
            if self.w.sharded:
                self.wait(slot)
            self.w.master_into(slot)
            if self.w.sharded:
                self.gather(slot)
                self.wait(slot)
            self.showing = True

    def resume(self, t: int, slot: int) -> None:
        """Before batch t runs (t steps taken): the prediction back into the newest slot."""
        if self.showing:
            self.publish(t, slot)


__all__ = ["Compensator"]
