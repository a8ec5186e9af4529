"""The memory of one pipeline stage: the engine's weight, gradient and optimizer buffers
(`state_bytes`) and the activations its schedule keeps in flight (`stage_memory`); the cost
model (cost_model.py) and the pre-start memory check (memory_check.py) both use it. The module
docstring of cost_model.py says what is counted.
"""
from __future__ import annotations

from functools import lru_cache

from megatron_2bw.config.control_flags import TAIL
from megatron_2bw.models.flops import DTYPE_BYTES
from megatron_2bw.optim.shard_layout import bucket_elements, padded_numel
from megatron_2bw.schedule.compensation_methods import (NONE as NO_COMPENSATION,
                                                        compensation_method, keeps_master)
from megatron_2bw.schedule.kinds import schedule_kind_of

OPTIMIZER_COPIES = {"adam": 2, "sgd": 1}


def state_bytes(params: int, num_slots: int, dtype: str, optimizer: str = "adam",
                shards: int = 1, tied: int = 0, compensation: str = NO_COMPENSATION,
                grad_buffers: int | None = None, grad_accumulation: str = "fp32",
                bucket: int | None = None) -> dict:
    """A fresh dict of `_state_bytes` (the search asks it for the same stage many times)."""
    return dict(_state_bytes(params, num_slots, dtype, optimizer, shards, tied, compensation,
                             grad_buffers, grad_accumulation, bucket))


@lru_cache(maxsize=65536)
def _state_bytes(params: int, num_slots: int, dtype: str, optimizer: str, shards: int,
                 tied: int, compensation: str, grad_buffers: int | None,
                 grad_accumulation: str, bucket: int | None) -> dict:
    """Bytes of the engine's per-stage weight, gradient and optimizer buffers; `shards` w with
    the distributed optimizer (`tied`: parameters of a cross-stage tied weight on this stage,
    which form a region of their own); `compensation`: --2bw-compensation (a method whose slots
    hold predictions keeps an fp32 master in fp32 runs too, sharded like the bf16/fp16 one; one
    that keeps the latest gradient adds one fp32 copy to the optimizer state, sharded like it);
    `grad_buffers`: fp32 gradient buffers (None: one per slot; fewer, a one-buffer 2BW, keeps
    each slot's loss in one fp32 element of its own: pipeline/weights.py); `grad_accumulation`:
    --grad-accumulation (bf16/fp16 "buffer" keeps a low-precision gradient of the stage; "fp32"
    none: each parameter's exists only while its hook adds it into fp32, as in Megatron);
    `bucket`: --ddp-bucket-size (None: Megatron's default for w; with the distributed optimizer
    every bucket is padded to a multiple of w, shard_layout.py `padded_numel`)."""
    p = DTYPE_BYTES[dtype]
    mixed = dtype != "fp32"
    n = padded_numel(params, tied, shards, bucket_elements(bucket, shards)) if shards > 1 \
        else params
    shard = n // shards
    g = num_slots if grad_buffers is None else grad_buffers
    return {"weights": num_slots * n * p,
            "master": shard * 4 if keeps_master(dtype, compensation) else 0,
            "grads": g * (n + TAIL) * 4 + (num_slots * 4 if g < num_slots else 0),
            "model_grad": n * p if mixed and grad_accumulation == "buffer" else 0,
            "optimizer": (OPTIMIZER_COPIES[optimizer]
                          + compensation_method(compensation).keeps_grad) * shard * 4}


def stage_tied(costs: list, lo: int, hi: int, d: int) -> int:
    """Parameters of a cross-stage tied weight that stage [lo, hi) holds (0 when d == 1)."""
    if d == 1:
        return 0
    return (costs[lo].tied_params if lo == 0 else 0) + \
        (costs[-1].tied_params if hi == len(costs) else 0)


def stage_params(costs: list, lo: int, hi: int, prefix: dict | None = None) -> int:
    """Parameters of layers [lo, hi): a tied weight counted once when both users are here."""
    n = prefix["params"][hi] - prefix["params"][lo] if prefix else \
        sum(c.params for c in costs[lo:hi])
    if lo == 0 and hi == len(costs):
        n -= costs[-1].tied_params
    return n


def _recomputed(cost) -> bool:
    """Megatron's full recomputation (and the engine's) covers the transformer layers only."""
    return cost.name == "transformer"


def activation_bytes(costs: list, lo: int, hi: int, recompute: bool, last: bool,
                     prefix: dict | None = None, selective: bool = False) -> tuple:
    """(bytes stashed per in-flight microbatch, extra working bytes once) for layers [lo, hi);
    `recompute` full, `selective` core-attention recomputation."""
    out = 0.0 if last else costs[hi - 1].output_bytes  # the stage output kept for the backward
    col = "keep_rc" if recompute else ("keep_sel" if selective else "act")
    if prefix:
        kept = prefix[col][hi] - prefix[col][lo]
    else:
        kept = sum(_kept(c, recompute, selective) for c in costs[lo:hi])
    extra = 0.0
    if recompute or selective:
        working = "act_bytes" if recompute else "core_attention_bytes"
        if prefix and "n_rc" in prefix and prefix["n_rc"][hi] == prefix["n_rc"][lo]:
            pass  # no transformer layer here (the prefix counts them)
        elif prefix and "rc_max" in prefix:
            extra = prefix["rc_max"][working]  # every transformer layer is the same spec
        else:
            extra = max((getattr(c, working) for c in costs[lo:hi] if _recomputed(c)),
                        default=0.0)
    return kept + out, extra


def _kept(cost, recompute: bool, selective: bool = False) -> float:
    if recompute and _recomputed(cost):
        return cost.input_bytes
    if selective and _recomputed(cost):
        return cost.act_bytes - cost.core_attention_bytes
    return cost.act_bytes


def stage_memory(costs: list, lo: int, hi: int, schedule: str, d: int, m: int, stage: int,
                 dtype: str, optimizer: str, recompute: bool, prefix: dict | None = None,
                 selective: bool = False, shards: int = 1,
                 compensation: str = NO_COMPENSATION,
                 logits_bytes: float = 0.0, grad_buffers: int | str | None = None,
                 grad_accumulation: str = "fp32",
                 microbatches_per_flush: int | None = None) -> tuple[dict, int]:
    """(bytes stage `stage` (layers [lo, hi)) holds at its peak, by kind (state_bytes' keys,
    "activations", "total"), peak in-flight microbatches). `costs` must be computed with the
    layout's sequence parallelism; `shards` is w with the distributed optimizer.
    `logits_bytes` (one fp32 copy of a microbatch's logits): GPipe as it runs keeps, on its
    last stage, each of its m in-flight microbatches' loss state until the backward: the head's
    activations (`per_mb`, times m) count it, one fp32 copy of the logits per microbatch, which
    is all the loss saves (torch's cross entropy keeps its fp32 log-softmax, the vocab-parallel
    one its fp32 softmax, computed in place of the fp32 logits; Megatron's, which the paper's
    GPipe ran, the same). The fp32 logits beside it exist only while one microbatch's loss is
    computed: one more copy, once (1F1B schedules run that backward right after the forward;
    their transient is left out as it was). `grad_buffers`: --2bw-grad-buffers (None: the
    kind's); `grad_accumulation`: --grad-accumulation (`state_bytes`);
    `microbatches_per_flush`: --gpipe-microbatches-per-flush (GPipe's in-flight microbatches)."""
    return stage_memory_of(costs, schedule, d, m, dtype, optimizer, recompute, prefix,
                           selective, shards, compensation, logits_bytes, grad_buffers,
                           grad_accumulation, microbatches_per_flush)(stage, lo, hi)


def stage_memory_of(costs: list, schedule: str, d: int, m: int, dtype: str, optimizer: str,
                    recompute: bool, prefix: dict | None = None, selective: bool = False,
                    shards: int = 1, compensation: str = NO_COMPENSATION,
                    logits_bytes: float = 0.0, grad_buffers: int | str | None = None,
                    grad_accumulation: str = "fp32", microbatches_per_flush: int | None = None):
    """`stage_memory` as a function of (stage, lo, hi), what does not depend on the stage taken
    once (the search asks it for tens of thousands of stages)."""
    kind = schedule_kind_of(schedule, grad_buffers, microbatches_per_flush)
    slots, n, last_logits = kind.num_slots, len(costs), kind.stashes_logits and logits_bytes

    def of(stage: int, lo: int, hi: int) -> tuple[dict, int]:
        mem = state_bytes(stage_params(costs, lo, hi, prefix), slots, dtype, optimizer, shards,
                          stage_tied(costs, lo, hi, d), compensation,
                          kind.grad_buffers_of(stage), grad_accumulation)
        per_mb, extra = activation_bytes(costs, lo, hi, recompute, stage == d - 1, prefix,
                                         selective)
        if last_logits and hi == n:
            extra += logits_bytes  # the fp32 logits beside the kept softmax: one microbatch's, once
        peak = kind.in_flight(d, m, stage)
        mem["activations"] = peak * per_mb + extra
        mem["total"] = sum(mem.values())
        return mem, peak
    return of


def layout_stage_memory(setup, L, times):
    """`stage_memory` of layout L as a function of (stage s, its layers [lo, hi)) (cost_model's
    Setup, Layout and LayerTimes)."""
    b, t, sp = L.micro_batch, L.tensor, L.sequence_parallel
    logits = 4.0 * b * setup.model.seq_length * setup.model.vocab_size / t  # fp32, per rank
    return stage_memory_of(times.get(b, t, sp)[0], L.schedule, L.pipeline, L.num_microbatches,
                           setup.dtype, setup.optimizer, L.recompute, times.prefix(b, t, sp),
                           L.selective, L.shards, setup.compensation, logits, L.grad_buffers,
                           setup.grad_accumulation, L.microbatches_per_flush)


def largest_affine_fit(bases: list, slopes: list, limit: float, cap: int) -> int:
    """The largest k in 1 .. cap with bases[i] + (k - 1) slopes[i] <= limit for every i (0
    when not even k = 1 fits): how many microbatches may be in flight when each holder's bytes
    are affine in them (GPipe's flush size: planner/search.py, planner/memory_check.py)."""
    if any(b > limit for b in bases):
        return 0
    k = min([cap] + [int((limit - b) // s) + 1 for b, s in zip(bases, slopes) if s > 0])
    while k > 1 and any(b + (k - 1) * s > limit for b, s in zip(bases, slopes)):
        k -= 1  # float rounding at the edge
    return k


__all__ = ["largest_affine_fit", "layout_stage_memory", "stage_memory_of", "OPTIMIZER_COPIES",
           "state_bytes", "stage_tied", "stage_params", "activation_bytes", "stage_memory"]
