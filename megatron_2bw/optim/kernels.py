"""Which kernel steps a flat optimizer (optim/optimizer.py's `impl`): `OptimizerConfig.impl`, the
Megatron-style flag `--optimizer-impl {auto,native,torch-fused,apex,unfused}` (default auto), or
`make_optimizer(..., impl=)`, which beats the config. `resolve_impl` turns it into a kernel: auto
is `choose_impl`'s, the first of torch-fused, apex, unfused that works on the device (the same
rule on every device: never native); any other name is that kernel, or a one-line ConfigError
when it cannot run here (the config's checks, config/checks.py `optimizer_impl_error`, refuse
what they can see before any process group: an unknown name, native or apex with SGD, native
with --distributed-backend nccl or without a C compiler, apex not importable).

    native       opt-in (--optimizer-impl native): Adam on a CPU, optim/native.py's C kernel,
                 built on first use where the machine has a C compiler: one pass that steps out
                 of place without a copy and writes 2BW's prediction in the same pass
                 (`step(..., predict=)`, `fuses_prediction`); its own rounding (relative 1e-7
                 per step from torch's), so runs with it are not bitwise torch's.
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

from megatron_2bw.config import ConfigError
from megatron_2bw.config.checks import IMPL_MISSING, OPTIMIZER_IMPLS, optimizer_impl_error
from megatron_2bw.optim import native

AUTO = OPTIMIZER_IMPLS[0]  # "auto": `choose_impl`
IMPLS = OPTIMIZER_IMPLS[1:]  # the kernels


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
    """The default kernel for optimizer `kind` on `device` ("auto"; see the docstring): torch's
    fused kernel where it works, else apex (Adam on CUDA), else unfused; never native."""
    if _torch_fused_works(torch.device(device), kind):
        return "torch-fused"
    if kind == "adam" and torch.device(device).type == "cuda" and _apex_adam() is not None:
        return "apex"
    return "unfused"


def resolve_impl(impl: str | None, kind: str, device) -> str:
    """The kernel that steps optimizer `kind` on `device` for `impl` (None or "auto":
    `choose_impl`'s); a one-line ConfigError naming --optimizer-impl when it cannot run here."""
    impl = impl or AUTO
    device = torch.device(device)
    error = optimizer_impl_error(impl, kind, device.type)
    if error is None and impl == AUTO:
        return choose_impl(device, kind)
    if error is None and ((impl == "native" and native.library() is None)
                          or (impl == "apex" and _apex_adam() is None)):
        error = IMPL_MISSING[impl]
    if error is None and impl == "torch-fused" and not _torch_fused_works(device, kind):
        error = (f"--optimizer-impl torch-fused: this torch ({torch.__version__}) has no fused "
                 f"{kind} kernel for {device}: use --optimizer-impl auto")
    if error:
        raise ConfigError(error)
    return impl
