"""Activation recomputation: run a block without keeping its activations and re-run it in
backward with the random state of the original forward restored (same dropout masks)."""
from __future__ import annotations

import torch

from megatron_2bw.tensor_parallel.random import RNGTracker, _device_state, _set_device_state


def _get_states(tracker: RNGTracker | None):
    return tracker.get_states() if tracker is not None else (torch.get_rng_state(),
                                                             _device_state())


def _set_states(tracker: RNGTracker | None, states) -> None:
    if tracker is not None:
        tracker.set_states(states)
    else:
        torch.set_rng_state(states[0])
        _set_device_state(states[1])


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, tracker, *args):
        ctx.run, ctx.tracker = run, tracker
        ctx.states = _get_states(tracker)
        with torch.no_grad():
            out = run(*args)
        ctx.save_for_backward(*args)
        ctx.tuple_out = isinstance(out, tuple)
        return out

    @staticmethod
    def backward(ctx, *grads):
        inputs = [a.detach().requires_grad_(a.requires_grad) for a in ctx.saved_tensors]
        now = _get_states(ctx.tracker)
        _set_states(ctx.tracker, ctx.states)
        with torch.enable_grad():
            out = ctx.run(*inputs)
        _set_states(ctx.tracker, now)
        outs = out if ctx.tuple_out else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad and g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None) + tuple(a.grad if a.requires_grad else None for a in inputs)


def recompute(run, tracker: RNGTracker | None, *args):
    """run(*args) with its activations recomputed in backward."""
    return _Recompute.apply(run, tracker, *args)
