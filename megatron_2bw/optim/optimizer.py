"""Optimizers over one flat fp32 buffer: one fused kernel per step where the device has one.

`step(src, grad, dst, lr)` computes dst = update(src, grad). dst may be src (one weight version) or
another buffer (2BW writes the new version next to the one still in use: torch's kernels first set
dst to src and update it in place, the native one reads src and writes dst). The arithmetic matches
torch.optim.AdamW / torch.optim.SGD, so a plain PyTorch loop is the reference
(tests/unit/test_engine_units.py). The flat layout puts decayed parameters (matrices, embeddings)
first: [0, decay_end), so a step is at most two kernel calls (the decayed range, then the rest with
weight decay 0).

Kernels (`impl`): optim/kernels.py. `cfg.impl` (--optimizer-impl; default auto: torch's fused
kernels where they run, else apex or unfused, on every device) or `impl=` (beats it) names one;
the native CPU kernel runs only when asked for.

State (`state_dict`): {"exp_avg", "exp_avg_sq", "steps"} / {"momentum", "steps"}, the same for
every kernel, so a checkpoint moves between machines with different kernels. Adam made with
`keep_grad=True` also keeps the gradient of its latest step, "last_grad" (one more fp32 buffer and
one copy per step; `predict(..., nesterov=True)` reads it); a state without it (an older
checkpoint, another method's) loads with last_grad = exp_avg, so the next nesterov prediction is
the plain one (`OPTIONAL_STATE`: the keys a loaded state may lack).

Layout of every buffer an optimizer touches (src, grad, dst and its state), element i of each
being the same parameter element (pipeline/weights.py owns the order):

    [0, decay_end)        parameters with weight decay (matrices, embeddings)
    [decay_end, numel)    parameters without (biases, norms)

Decoupled lr (--decoupled-lr, optim/lr.py): `decoupled`, a few (lo, hi) ranges inside the layout
(the embedding and output parameters, pipeline/weights.py `decoupled`), step at lr class 1. Every
lr argument (`step`'s lr, `predict`'s, the spike's) is then a float (one lr for all) or a pair
(lr, decoupled lr). The optimizer cuts the layout once, at construction, into `segments` (lo, hi,
weight decay, lr class): a step is one kernel call per segment (at most four), never per
parameter.

Nothing else (no per-parameter boundary, no alignment) matters to the arithmetic: every kernel is
elementwise, and `steps` is the only shared scalar. So a shard is just a contiguous range
[lo, hi) of the flat buffers: an optimizer made with `make_optimizer(cfg, hi - lo,
clamp(decay_end - lo, 0, hi - lo), device, decoupled=the ranges clamped and shifted by -lo)` and
stepped on the views `buf[lo:hi]` updates those elements as the unsharded optimizer would (its
state is the slice [lo, hi) of the unsharded state): bit for bit with the unfused kernel; torch's
fused kernels round the few elements of a vector tail at a cut differently (1 ulp).
tests/unit/test_fused_optim.py checks a split step against the whole one.

One pure function of the state serves 2BW's staleness compensation (pipeline/compensation.py):
it changes none of the optimizer's state, and a fused `step` must keep the state's meaning for it.
`predict(src, dst, lr)`: dst = the weights the next step would make of src if its gradient were
the one the state expects (Adam: the bias-corrected moments' update; SGD: the momentum buffer).
Adam's options: `nesterov=True` (with keep_grad): the latest gradient stands in for the next one,
the Nesterov (NAdam) form of the next update: m_hat is replaced by (b1 * m + (1 - b1) *
last_grad) / bias1; `spike=(grad, lr)`, right after a step with `grad`: first add to src the part
of grad's momentum contribution that a one-step-late gradient missed (spike compensation for
delay 1). `predict_chunks` is the same work as a generator of chunks (`chunk_elements`), so that
the engine can run it piece by piece while it waits for its peers; the chunking changes no bit.
"""
from __future__ import annotations

import math

import torch

from megatron_2bw.config import OptimizerConfig
from megatron_2bw.optim import native
from megatron_2bw.optim.kernels import (IMPLS, _apex_adam, _torch_fused_works,  # noqa: F401
        resolve_impl)
from megatron_2bw.optim.lr import rate_of
from megatron_2bw.optim.segments import lr_runs, segments, within
OPTIONAL_STATE = ("last_grad",)  # state keys a loaded state may lack (see the docstring)


class _Ranges:
    """The segments of the flat layout (`segments`: weight decay and lr class); the
    compensation's `predict` of either optimizer."""

    def _cut(self, numel: int, decay_end: int, cfg: OptimizerConfig, decoupled) -> None:
        self.decay_end, self.cfg, self.numel = decay_end, cfg, numel
        self.decoupled = tuple(tuple(r) for r in decoupled)
        self.segments = segments(numel, decay_end, cfg.weight_decay, self.decoupled)
        self.lr_runs = lr_runs(self.segments)

    def predict(self, src: torch.Tensor, dst: torch.Tensor, lr: float, nesterov: bool = False,
                spike: tuple | None = None) -> None:
        """`predict_chunks`, all of it now."""
        for _ in self.predict_chunks(src, dst, lr, nesterov, spike):
            pass

    def fuses_prediction(self, dtype: torch.dtype) -> bool:
        """Whether `step(..., predict=)` writes a prediction of `dtype` in the step's pass."""
        return False



class FlatAdamW(_Ranges):
    def __init__(self, numel: int, decay_end: int, device, cfg: OptimizerConfig,
                 impl: str | None = None, keep_grad: bool = False, decoupled=()):
        self._cut(numel, decay_end, cfg, decoupled)
        self.impl = resolve_impl(impl or cfg.impl, "adam", device)
        self.exp_avg = torch.zeros(numel, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(numel, dtype=torch.float32, device=device)
        # the gradient of the latest step (keep_grad: `predict(..., nesterov=True)` reads it)
        self.last_grad = torch.zeros(numel, dtype=torch.float32, device=device) \
            if keep_grad else None
        self.steps = 0
        self._step_t = torch.zeros((), dtype=torch.float32, device=device)  # the fused kernels'
        self._scratch = None  # unfused: the denominator, allocated once
        self._chunk_scratch = None  # predict_chunks: a chunk's denominator and second term
        if self.impl == "apex":
            self._apex = _apex_adam()
            self._overflow = torch.zeros(1, dtype=torch.int32, device=device)

    def fuses_prediction(self, dtype: torch.dtype) -> bool:
        return self.impl == "native" and dtype in native.KINDS

    def step(self, src: torch.Tensor, grad: torch.Tensor, dst: torch.Tensor, lr: float,
             keep_grad: bool = True, predict: tuple | None = None) -> None:
        """`keep_grad=False` (keep_grad optimizers): leave the copy of `grad` into last_grad to
        the next `predict_chunks(..., fresh_grad=grad)`, which makes it chunk by chunk.
        `predict` = (out, lr', nesterov, spike) (`fuses_prediction(out.dtype)` only): the step
        also writes into `out` what `predict_chunks(dst, out, lr', nesterov, spike=(grad, lr) if
        spike)` would, in the same pass (`spike`: dst gets the spike first, as there)."""
        self.steps += 1
        if self.impl == "native":
            self._native_step(src, grad, dst, lr, keep_grad, predict)
            return
        if predict is not None:
            raise ValueError(f"the {self.impl} kernel does not predict in its step: call "
                             "predict_chunks after it")
        if dst is not src:
            dst.copy_(src)
        if self.last_grad is not None and keep_grad:
            self.last_grad.copy_(grad)
        c = self.cfg
        if self.impl == "torch-fused":
            self._step_t.fill_(self.steps)  # a device fill, no host sync
        for lo, hi, wd, k in self.segments:
            p, g, rate = dst[lo:hi], grad[lo:hi], rate_of(lr, k)
            m, v = self.exp_avg[lo:hi], self.exp_avg_sq[lo:hi]
            if self.impl == "torch-fused":
                torch._fused_adamw_([p], [g], [m], [v], [], [self._step_t], lr=rate,
                                    beta1=c.adam_beta1, beta2=c.adam_beta2, weight_decay=wd,
                                    eps=c.adam_eps, amsgrad=False, maximize=False)
            elif self.impl == "apex":
                applier, kernel = self._apex
                applier(kernel, self._overflow, [[g], [p], [m], [v]], rate, c.adam_beta1,
                        c.adam_beta2, c.adam_eps, self.steps, 1, 1, wd)  # AdamW mode, bias corr.
            else:
                self._unfused(p, g, m, v, rate, wd, lo, hi)

    def _native_step(self, src, grad, dst, lr: float, keep_grad: bool, predict) -> None:
        c = self.cfg
        out, pred_lr, nesterov, spike = predict if predict is not None else (None, 0.0, 0, 0)
        if nesterov and self.last_grad is None:
            raise ValueError("predict(nesterov=True) reads the latest gradient: make the "
                             "optimizer with keep_grad=True")
        keep = self.last_grad if keep_grad else None
        for lo, hi, wd, j in self.segments:
            rate = rate_of(lr, j)
            k = native.coefficients(c.adam_beta1, c.adam_beta2, c.adam_eps, self.steps, rate, wd,
                                    rate_of(pred_lr, j), rate if spike else 0.0)
            native.adamw_step(native.library(), src[lo:hi], dst[lo:hi], grad[lo:hi],
                              self.exp_avg[lo:hi], self.exp_avg_sq[lo:hi], k,
                              keep[lo:hi] if keep is not None else None,
                              out[lo:hi] if out is not None else None, bool(spike), bool(nesterov))

    def _unfused(self, p, g, m, v, lr: float, wd: float, lo: int, hi: int) -> None:
        c = self.cfg
        b1, b2 = c.adam_beta1, c.adam_beta2
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        bias1 = 1 - b1 ** self.steps
        if self._scratch is None:
            self._scratch = torch.empty_like(self.exp_avg_sq)
        denom = self._denom(lo, hi, out=self._scratch[lo:hi])
        if wd:
            p.mul_(1 - lr * wd)
        p.addcdiv_(m, denom, value=-lr / bias1)

    def _denom(self, lo: int = 0, hi: int | None = None, out=None, scaled: bool = False
               ) -> torch.Tensor:
        """sqrt(v / bias2) + eps of the current state over [lo, hi) (into `out`, else a new fp32
        buffer): the one owner of Adam's denominator (the unfused step, predict and spike).
        `scaled`: sqrt(bias2) times it, sqrt(v) + eps * sqrt(bias2), one pass fewer (the caller
        multiplies its coefficient by sqrt(bias2))."""
        bias2 = 1 - self.cfg.adam_beta2 ** self.steps
        v = self.exp_avg_sq[lo:hi]
        if scaled:
            return torch.sqrt(v, out=out).add_(self.cfg.adam_eps * math.sqrt(bias2))
        return torch.sqrt(v, out=out).div_(math.sqrt(bias2)).add_(self.cfg.adam_eps)

    def predict_chunks(self, src: torch.Tensor, dst: torch.Tensor, lr: float,
                       nesterov: bool = False, spike: tuple | None = None,
                       fresh_grad: torch.Tensor | None = None):
        """A generator that writes dst = src after the step the current moments imply at `lr`,
        one chunk (`chunk_elements`) per item, yielding its range (lo, hi): src * (1 - lr * wd) on
        the decayed range, minus lr * m_hat / (sqrt(v_hat) + eps), bias corrections of the steps
        taken (a gradient equal to m_hat would leave m_hat and v_hat unchanged).
        `nesterov` (keep_grad only): m_hat becomes (b1 * m + (1 - b1) * last_grad) / bias1, the
        latest gradient standing in for the next one.
        `spike` = (grad, lr_step), right after step(..., grad, ..., lr_step) wrote src: first move
        src (in place) from the momentum update m_hat to the delay-compensated one
        (b1 * m + (1 - b1) * grad) / bias1, i.e. add -lr_step * (1 - b1) * (grad - m) / bias1 /
        (sqrt(v_hat) + eps), then predict from it (one denominator for both).
        `fresh_grad`: the latest step's gradient, which that step did not keep
        (`step(..., keep_grad=False)`): each chunk copies it into last_grad first, so last_grad
        is whole once the generator is done (and must not be read before).
        The arithmetic is fp32 and elementwise, so the chunking changes no bit; dst (any float
        dtype) is written once. No state changes; the state, src, dst (and grad) must not change
        until the generator is done. Before any step: dst = src. Per chunk: two passes over v,
        one over src, m and dst (and src's decayed part again with weight decay); nesterov one
        more over m and last_grad, the spike one over grad, m and src."""
        if nesterov and self.last_grad is None:
            raise ValueError("predict(nesterov=True) reads the latest gradient: make the "
                             "optimizer with keep_grad=True")
        if self.steps == 0:
            dst.copy_(src)
            yield 0, self.numel
            return
        c = self.cfg
        b1 = c.adam_beta1
        scale = math.sqrt(1 - c.adam_beta2 ** self.steps) / (1 - b1 ** self.steps)
        # -lr * scale times m_hat / scaled denominator (`_denom(scaled=True)`), per lr class
        decay_end = self.decay_end if c.weight_decay else 0
        fp32_dst = dst.dtype == torch.float32
        own = fp32_dst and dst.data_ptr() != src.data_ptr()  # dst can hold an fp32 term
        size = chunk_elements(src.device, self.numel)
        lib = native.library() if self.impl == "native" and dst.dtype in native.KINDS else None
        if lib is None and (self._chunk_scratch is None
                            or self._chunk_scratch.numel() != 2 * size):  # torch ops only
            self._chunk_scratch = torch.empty(2 * size, dtype=torch.float32, device=src.device)
        for lo in range(0, self.numel, size):
            hi = min(lo + size, self.numel)
            n = hi - lo
            if lib is not None:  # the same pass as a fused step's (native.py)
                if fresh_grad is not None:
                    self.last_grad[lo:hi].copy_(fresh_grad[lo:hi])
                self._native_predict(lib, src, dst, lr, nesterov, spike, lo, hi)
                yield lo, hi
                continue
            d = self._denom(lo, hi, out=self._chunk_scratch[:n], scaled=True)
            term = self._chunk_scratch[size:size + n]
            s, m = src[lo:hi], self.exp_avg[lo:hi]
            if fresh_grad is not None:
                self.last_grad[lo:hi].copy_(fresh_grad[lo:hi])
            runs = [(a - lo, b - lo, k) for a, b, k in within(self.lr_runs, lo, hi)]
            if spike is not None:
                grad, lr_step = spike
                diff = torch.sub(grad[lo:hi], m, out=term)
                for a, b, k in runs:
                    s[a:b].addcdiv_(diff[a:b], d[a:b],
                                    value=-rate_of(lr_step, k) * (1 - b1) * scale)
            if nesterov:  # b1 * m + (1 - b1) * g, in dst when that does not overwrite src
                m = torch.lerp(m, self.last_grad[lo:hi], 1 - b1, out=dst[lo:hi] if own else term)
            for a, b, k in runs:
                rate, part = rate_of(lr, k), dst[lo + a:lo + b]
                cut = min(b, decay_end - lo) - a  # this part's elements with weight decay
                # fp32 dst, or nothing to add after: straight into dst (fp32, rounded once)
                out = torch.addcdiv(s[a:b], m[a:b], d[a:b], value=-rate * scale,
                                    out=part if fp32_dst or cut <= 0 else d[a:b])
                if cut > 0:
                    out[:cut].add_(s[a:a + cut], alpha=-rate * c.weight_decay)
                    if not fp32_dst:
                        part.copy_(out)
            yield lo, hi

    def _native_predict(self, lib, src, dst, lr, nesterov, spike, lo, hi) -> None:
        c = self.cfg
        grad, lr_step = spike if spike is not None else (None, 0.0)
        for a, b, wd, j in within(self.segments, lo, hi):
            if b > a:
                k = native.coefficients(c.adam_beta1, c.adam_beta2, c.adam_eps, self.steps, 0.0,
                                        wd, rate_of(lr, j), rate_of(lr_step, j))
                native.adamw_predict(lib, src[a:b], self.exp_avg[a:b], self.exp_avg_sq[a:b],
                                     dst[a:b], k, grad[a:b] if grad is not None else None,
                                     self.last_grad[a:b] if nesterov else None)

    def state_dict(self) -> dict:
        state = {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq, "steps": self.steps}
        if self.last_grad is not None:
            state["last_grad"] = self.last_grad
        return state

    def load_state_dict(self, state: dict) -> None:
        """A state with or without "last_grad" (without: last_grad = exp_avg, see the module
        docstring); one with it loads into an optimizer that keeps none too."""
        self.exp_avg.copy_(state["exp_avg"])
        self.exp_avg_sq.copy_(state["exp_avg_sq"])
        if self.last_grad is not None:
            self.last_grad.copy_(state.get("last_grad", state["exp_avg"]))
        self.steps = int(state["steps"])


class FlatSGD(_Ranges):
    """torch.optim.SGD semantics: coupled weight decay, momentum buffer initialized to the first
    gradient."""

    def __init__(self, numel: int, decay_end: int, device, cfg: OptimizerConfig,
                 impl: str | None = None, decoupled=()):
        self._cut(numel, decay_end, cfg, decoupled)
        self.impl = resolve_impl(impl or cfg.impl, "sgd", device)
        self.momentum = torch.zeros(numel, dtype=torch.float32, device=device)
        self.steps = 0

    def step(self, src: torch.Tensor, grad: torch.Tensor, dst: torch.Tensor, lr: float) -> None:
        if dst is not src:
            dst.copy_(src)
        c = self.cfg
        for lo, hi, wd, k in self.segments:
            p, g, mom, rate = dst[lo:hi], grad[lo:hi], self.momentum[lo:hi], rate_of(lr, k)
            if self.impl == "torch-fused":
                torch._fused_sgd_([p], [g], [mom] if c.sgd_momentum else [], weight_decay=wd,
                                  momentum=c.sgd_momentum, lr=rate, dampening=0.0, nesterov=False,
                                  maximize=False, is_first_step=self.steps == 0)
                continue
            if wd:
                g.add_(p, alpha=wd)
            update = g
            if c.sgd_momentum:
                if self.steps == 0:
                    mom.copy_(g)
                else:
                    mom.mul_(c.sgd_momentum).add_(g)
                update = mom
            p.add_(update, alpha=-rate)
        self.steps += 1

    def predict_chunks(self, src: torch.Tensor, dst: torch.Tensor, lr: float,
                       nesterov: bool = False, spike: tuple | None = None,
                       fresh_grad: torch.Tensor | None = None):
        """A generator that writes dst = src - lr * momentum buffer, one chunk per item, yielding
        its range (lo, hi): the next step if the momentum keeps its direction (weight decay is
        inside the buffer, as torch.optim.SGD couples it). Arithmetic in fp32, dst written once;
        no state changes; zero buffer (no step yet): dst = src. No nesterov form and no spike
        (compensation.py allows them with Adam only)."""
        if nesterov or spike is not None:
            raise ValueError("predict(nesterov=True) and the spike are defined for Adam only, "
                             "not SGD")
        size = chunk_elements(src.device, self.numel)
        for lo in range(0, self.numel, size):
            hi = min(lo + size, self.numel)
            for a, b, k in within(self.lr_runs, lo, hi):  # rounded once
                torch.add(src[a:b], self.momentum[a:b], alpha=-rate_of(lr, k), out=dst[a:b])
            yield lo, hi

    def state_dict(self) -> dict:
        return {"momentum": self.momentum, "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.momentum.copy_(state["momentum"])
        self.steps = int(state["steps"])


def chunk_elements(device, numel: int) -> int:
    """Elements per chunk of `predict_chunks`: a few MB on a CPU, where the chunk's denominator
    stays in cache between its two passes (8 M elements: 9.7 ms in chunks of 2^18, 11.7 ms
    whole) and the engine can run chunks while it waits for a peer; 2^24 (64 MB of fp32) on an
    accelerator, whose kernels queue behind each other anyway: the transient buffers stay small
    for a stage of any size, at a few kernel launches per 16 M parameters."""
    size = 2 ** 18 if torch.device(device).type == "cpu" else 2 ** 24
    return max(1, min(size, numel))


def make_optimizer(cfg: OptimizerConfig, numel: int, decay_end: int, device,
                   impl: str | None = None, keep_grad: bool = False, decoupled=()):
    """The flat optimizer of `cfg.name` with kernel `impl`, else `cfg.impl` (kernels.py);
    `keep_grad`: Adam keeps its latest gradient; `decoupled`: the (lo, hi) ranges at lr class 1
    (the module docstring)."""
    if cfg.name == "adam":
        return FlatAdamW(numel, decay_end, device, cfg, impl, keep_grad=keep_grad,
                         decoupled=decoupled)
    if keep_grad:
        raise ValueError(f"keep_grad is defined for --optimizer adam, not {cfg.name}")
    return FlatSGD(numel, decay_end, device, cfg, impl, decoupled=decoupled)


def torch_reference_optimizer(cfg: OptimizerConfig, named_params):
    """The torch.optim equivalent (used by the single-process reference): matrices decay,
    vectors (biases, norms) do not; with --decoupled-lr the embedding and output parameters
    (`is_embedding_or_output_parameter`) are a group of their own, marked "decoupled" (Megatron's
    is_decoupled_lr), whose lr the caller sets."""
    params = [p for _, p in named_params]
    split = cfg.decoupled_lr is not None
    own = [p for p in params if split and getattr(p, "is_embedding_or_output_parameter", False)]
    rest = [p for p in params if all(p is not q for q in own)]
    groups = [{"params": [p for p in rest if p.ndim >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in rest if p.ndim < 2], "weight_decay": 0.0}]
    if own:
        groups += [{"params": [p for p in own if p.ndim >= 2], "weight_decay": cfg.weight_decay,
                    "decoupled": True},
                   {"params": [p for p in own if p.ndim < 2], "weight_decay": 0.0,
                    "decoupled": True}]
        groups = [g for g in groups if g["params"]]
    if cfg.name == "adam":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                 eps=cfg.adam_eps, foreach=False)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.sgd_momentum, foreach=False)
