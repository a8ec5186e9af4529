"""A stage's gradient reductions in the cost model: what each costs on its links and what of
the data-parallel one the stage's last backward of the batch hides (cost_model.py's docstring
says what is counted; `stage_plan` prices every stage with `_reduction`)."""
from __future__ import annotations

from megatron_2bw.config.control_flags import TAIL
from megatron_2bw.models.flops import DTYPE_BYTES
from megatron_2bw.optim.shard_layout import bucket_elements


def _after_last_backward(t_dp: float, bwd: float, params: int, w: int, setup) -> float:
    """What of a stage's data-parallel reduction (`t_dp`) is left when its last backward of the
    batch (`bwd`) ends: k buckets, produced evenly through that backward and reduced one after
    another, hide all but max(t_dp / k, t_dp - bwd (k - 1) / k); all of it when the buckets wait
    for R (--no-overlap-grad-reduce, bf16/fp16 --grad-accumulation buffer, one bucket) (`setup`:
    cost_model's Setup)."""
    if w == 1 or not setup.overlap_grad_reduce or (
            setup.dtype != "fp32" and setup.grad_accumulation == "buffer"):
        return t_dp
    k = max(1, -(-params // bucket_elements(setup.bucket, w)))
    return max(t_dp / k, t_dp - bwd * (k - 1) / k)


def _reduction(setup, topology, profile, params, tied, bwd, w, shards, dp_inter, dp_flows,
               tied_inter, comp) -> tuple:
    """One stage's gradient reductions: (data-parallel time, tied time, what of the data-parallel
    time its last backward leaves exposed, the step's compute, the all-gather of the new weights
    with the distributed optimizer, the compensation's work) (fp32 buffers unless Setup says;
    the tied slice goes over the tied group if split)."""
    g_bytes = setup.grad_reduce_bytes
    t_dp = topology.ring_time(g_bytes * (params + TAIL - tied), w, dp_inter, dp_flows)
    gather = 0.0
    if shards > 1:  # reduce-scatter now, all-gather of the new weights after the step
        p_bytes = DTYPE_BYTES[setup.dtype]
        gather = topology.ring_time(p_bytes * params, w, dp_inter, dp_flows) / 2
        t_dp /= 2
    t_tied = topology.ring_time(g_bytes * tied, 2 * w, tied_inter) if tied else 0.0
    exposed = _after_last_backward(t_dp, bwd, params - tied, w, setup)
    local = -(-params // shards)  # what this rank steps
    return t_dp, t_tied, exposed, profile.step_time(local), gather, comp(local)
