"""Which kernel steps a flat optimizer (optim/optimizer.py's `impl`): `choose_impl` picks the first
of these that works on the device; `make_optimizer(..., impl=)` forces one (`_check_impl`: a
one-line error when it cannot run here).

    native       Adam on a CPU: optim/native.py's C kernel, built on first use where the machine
                 has a C compiler: one pass that steps out of place without a copy and writes
                 2BW's prediction in the same pass (`step(..., predict=)`, `fuses_prediction`).
    torch-fused  torch._fused_adamw_ / torch._fused_sgd_ (the kernels behind
                 torch.optim.AdamW(fused=True)): one pass over weights, gradient and state
                 (CUDA; CPU from torch 2.4). Fused AdamW rounds differently from the unfused
                 arithmetic (relative 1e-7 per step), well inside the equivalence tolerance.
    apex         NVIDIA apex's FusedAdam kernel (amp_C.multi_tensor_adam, AdamW mode) when apex
                 is importable, for a CUDA torch without _fused_adamw_; SGD has no apex kernel
                 here and takes the next line.
    unfused      a few elementwise ops per step (about 8 passes) into a persistent scratch
                 buffer: no allocation per step; the fallback on any device.
"""
from __future__ import annotations

import functools

import torch

from megatron_2bw.optim import native

IMPLS = ("native", "torch-fused", "apex", "unfused")


def _apex_adam():
    """(multi_tensor_applier, amp_C.multi_tensor_adam) when apex is importable, else None."""
    try:
        import amp_C  # noqa: F401  (apex's compiled kernels)
        from apex.multi_tensor_apply import multi_tensor_applier
    except ImportError:
        return None
    return multi_tensor_applier, amp_C.multi_tensor_adam


@functools.lru_cache(maxsize=None)
def _torch_fused_works(device, kind: str) -> bool:
    """Whether torch's fused kernel of `kind` ("adam" or "sgd") runs on `device` (tried once per
    device on one element)."""
    op = getattr(torch, "_fused_adamw_" if kind == "adam" else "_fused_sgd_", None)
    if op is None:
        return False
    p, g, s = (torch.zeros(1, device=device) for _ in range(3))
    try:
        if kind == "adam":
            op([p], [g], [s], [torch.zeros(1, device=device)], [], [torch.ones((), device=device)],
               lr=0.0, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False,
               maximize=False)
        else:
            op([p], [g], [s], weight_decay=0.0, momentum=0.9, lr=0.0, dampening=0.0,
               nesterov=False, maximize=False, is_first_step=True)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def choose_impl(device, kind: str) -> str:
    """The fastest kernel available for optimizer `kind` on `device` (see the docstring)."""
    if kind == "adam" and torch.device(device).type == "cpu" and native.library() is not None:
        return "native"
    if _torch_fused_works(torch.device(device), kind):
        return "torch-fused"
    if kind == "adam" and torch.device(device).type == "cuda" and _apex_adam() is not None:
        return "apex"
    return "unfused"


def _check_impl(impl: str, kind: str, device) -> str:
    if impl not in IMPLS:
        raise ValueError(f"unknown optimizer kernel {impl!r}: use one of {IMPLS}")
    if impl == "apex" and (kind != "adam" or _apex_adam() is None):
        raise ValueError("the apex kernel needs Adam and an importable apex (pip install apex "
                         "with its CUDA extensions): use impl='torch-fused' or 'unfused'")
    if impl == "native" and (kind != "adam" or torch.device(device).type != "cpu"
                             or native.library() is None):
        raise ValueError("the native kernel is Adam on a CPU with a C compiler (cc or gcc) to "
                         "build it: use impl='torch-fused' or 'unfused'")
    if impl == "torch-fused" and not _torch_fused_works(torch.device(device), kind):
        raise ValueError(f"this torch ({torch.__version__}) has no fused {kind} kernel for "
                         f"{torch.device(device)}: use impl='unfused'")
    return impl
