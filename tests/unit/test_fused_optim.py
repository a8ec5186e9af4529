"""The flat optimizers' kernels (optim/optimizer.py): torch's fused AdamW/SGD (the default), apex's
FusedAdam kernel, the unfused fallback and the opt-in native one all equal torch.optim over a
real stage layout, in place and out of place (2BW), and their state is interchangeable (issue
16)."""
import copy
import sys
import types

import pytest
import torch

from megatron_2bw.config import OptimizerConfig
from megatron_2bw.optim import optimizer as O
from megatron_2bw.pipeline.weights import VersionedWeights
from test_engine_units import _model

KERNELS = [k for k in ("native", "torch-fused", "unfused")
           if (k != "torch-fused" or O._torch_fused_works(torch.device("cpu"), "adam"))
           and (k != "native" or O.native.library() is not None)]


KERNEL_OPTIMIZERS = [(k, n) for k in KERNELS for n in ("adam", "sgd")
                     if k != "native" or n == "adam"]  # the native kernel is Adam's


def _train(cfg, impl, steps=5, out_of_place=False):
    """(our flat weights by name, torch.optim's parameters by name) after `steps` steps of the
    same random gradients."""
    ref = _model()
    mine = copy.deepcopy(ref)
    w = VersionedWeights(mine, 2, "fp32", "cpu", tied=mine.tied)
    opt = O.make_optimizer(cfg, w.numel, w.decay_end, "cpu", impl=impl)
    ref_opt = O.torch_reference_optimizer(cfg, list(ref.named_parameters()))
    gen = torch.Generator().manual_seed(0)
    src, dst = (w.slots[1], w.slots[0]) if out_of_place else (w.slots[0], w.slots[0])
    for _ in range(steps):
        grads = {n: torch.randn(p.shape, generator=gen) for n, p in ref.named_parameters()}
        for n, p in ref.named_parameters():
            p.grad = grads[n].clone()
        ref_opt.step()
        flat = torch.cat([grads[n].reshape(-1) for n in w.names])
        opt.step(src, flat, dst, cfg.lr)
        if out_of_place:
            src.copy_(dst)  # next step starts from the newest version, as in the reference
    return w.named_tensors(dst), dict(ref.named_parameters()), opt


@pytest.mark.parametrize("out_of_place", [False, True], ids=["in-place", "2bw"])
@pytest.mark.parametrize("impl,name", KERNEL_OPTIMIZERS)
def test_every_kernel_matches_torch_optim(impl, name, out_of_place):
    cfg = OptimizerConfig(name=name, lr=1e-2, weight_decay=0.1, adam_beta2=0.95)
    mine, ref, opt = _train(cfg, impl, out_of_place=out_of_place)
    assert opt.impl == impl
    for n, p in ref.items():
        torch.testing.assert_close(mine[n], p.detach(), rtol=1e-6, atol=1e-7)


def test_the_default_kernel_is_torch_s_fused_one_where_it_runs():
    """--optimizer-impl auto: torch's kernels on every device; the native one only when asked
    for (test_native_adam.py)."""
    fused = "torch-fused" if O._torch_fused_works(torch.device("cpu"), "adam") else "unfused"
    assert O.make_optimizer(OptimizerConfig(), 10, 5, "cpu").impl == fused
    assert O.make_optimizer(OptimizerConfig(impl="auto"), 10, 5, "cpu").impl == fused
    assert O.make_optimizer(OptimizerConfig(name="sgd"), 10, 5, "cpu").impl == fused


def test_out_of_place_leaves_the_source_untouched_with_every_kernel():
    for impl in KERNELS:
        src, dst = torch.randn(100), torch.zeros(100)
        before = src.clone()
        opt = O.make_optimizer(OptimizerConfig(lr=1e-2), 100, 60, "cpu", impl=impl)
        opt.step(src, torch.ones(100), dst, 1e-2)
        assert torch.equal(src, before) and not torch.equal(dst, before), impl


def test_state_moves_between_kernels():
    """A checkpoint written with one kernel continues with another: same state layout."""
    if len(KERNELS) < 2:
        pytest.skip("this torch has no fused CPU kernel")
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    p0, grads = torch.randn(300, generator=gen), [torch.randn(300, generator=gen) for _ in range(6)]
    runs = {}
    for switch in (False, True):
        p = p0.clone()
        opt = O.make_optimizer(cfg, 300, 200, "cpu", impl=KERNELS[0])
        for i, g in enumerate(grads):
            if switch and i == 3:
                state = {k: v.clone() if torch.is_tensor(v) else v
                         for k, v in opt.state_dict().items()}
                opt = O.make_optimizer(cfg, 300, 200, "cpu", impl=KERNELS[-1])
                opt.load_state_dict(state)
            opt.step(p, g.clone(), p, cfg.lr)
        runs[switch] = p
    torch.testing.assert_close(runs[True], runs[False], rtol=1e-6, atol=1e-7)


def _fake_apex(monkeypatch):
    """apex's interface (multi_tensor_applier(op, overflow_buf, [g, p, m, v], lr, beta1, beta2,
    eps, step, adam_w_mode, bias_correction, weight_decay)) over torch's arithmetic, so the call
    our kernel makes is checked argument by argument; the real kernel needs CUDA and apex."""
    calls = []

    def multi_tensor_adam(chunk, overflow, lists, lr, b1, b2, eps, step, mode, bias, wd):
        calls.append((mode, bias, step))
        for g, p, m, v in zip(*lists):
            p.mul_(1 - lr * wd)
            m.lerp_(g, 1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (v.sqrt() / (1 - b2 ** step) ** 0.5).add_(eps)
            p.addcdiv_(m, denom, value=-lr / (1 - b1 ** step))

    apex = types.ModuleType("apex")
    mta = types.ModuleType("apex.multi_tensor_apply")
    mta.multi_tensor_applier = lambda op, buf, lists, *args: op(2048 * 32, buf, lists, *args)
    amp_c = types.ModuleType("amp_C")
    amp_c.multi_tensor_adam = multi_tensor_adam
    for name, mod in (("apex", apex), ("apex.multi_tensor_apply", mta), ("amp_C", amp_c)):
        monkeypatch.setitem(sys.modules, name, mod)
    return calls


def test_apex_kernel_gets_adamw_arguments_in_its_order(monkeypatch):
    calls = _fake_apex(monkeypatch)
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1)
    mine, ref, _ = _train(cfg, "apex", steps=3, out_of_place=True)
    for n, p in ref.items():
        torch.testing.assert_close(mine[n], p.detach(), rtol=1e-6, atol=1e-7)
    assert calls[0][:2] == (1, 1) and [c[2] for c in calls[-2:]] == [3, 3]  # two ranges


@pytest.mark.skipif(O._apex_adam() is not None, reason="apex is installed here")
def test_a_missing_kernel_is_a_one_line_error():
    with pytest.raises(ValueError, match=r"^--optimizer-impl apex needs NVIDIA apex with its "
                                         r"CUDA extensions \(amp_C\)") as e:
        O.make_optimizer(OptimizerConfig(), 10, 5, "cpu", impl="apex")
    assert "\n" not in str(e.value) and "--optimizer-impl auto" in str(e.value)
    with pytest.raises(ValueError, match=r"unknown --optimizer-impl 'fast'"):
        O.make_optimizer(OptimizerConfig(), 10, 5, "cpu", impl="fast")


@pytest.mark.skipif(not torch.cuda.is_available() or O._apex_adam() is None,
                    reason="needs CUDA and apex")
def test_real_apex_kernel_matches_torch_on_cuda():
    cfg = OptimizerConfig(lr=1e-2, weight_decay=0.1)
    p, g = torch.randn(1000, device="cuda"), torch.randn(1000, device="cuda")
    a, b = p.clone(), p.clone()
    for impl, x in (("apex", a), ("unfused", b)):
        opt = O.make_optimizer(cfg, 1000, 600, "cuda", impl=impl)
        for _ in range(3):
            opt.step(x, g.clone(), x, cfg.lr)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl,name", KERNEL_OPTIMIZERS)
def test_a_shard_steps_its_range_as_the_whole_buffer_does(impl, name):
    """The layout rule of optimizer.py's docstring, which a sharded (distributed) optimizer
    relies on: optimizers over contiguous ranges [lo, hi), with decay_end clamped into each,
    give the whole optimizer's result, out of place as 2BW steps: bit for bit with the unfused
    and the native kernel; torch's fused one rounds the elements of a vector tail (a cut)
    differently (1 ulp)."""
    cfg = OptimizerConfig(name=name, lr=1e-2, weight_decay=0.1, sgd_momentum=0.9)
    numel, decay_end, cuts = 1000, 613, (0, 250, 613, 700, 1000)  # one cut on decay_end
    gen = torch.Generator().manual_seed(2)
    src = torch.randn(numel, generator=gen)
    grads = [torch.randn(numel, generator=gen) for _ in range(3)]
    whole = O.make_optimizer(cfg, numel, decay_end, "cpu", impl=impl)
    shards = [(lo, hi, O.make_optimizer(cfg, hi - lo, min(max(decay_end - lo, 0), hi - lo),
                                        "cpu", impl=impl)) for lo, hi in zip(cuts, cuts[1:])]
    a, b = src.clone(), src.clone()
    for g in grads:
        out = torch.empty(numel)
        whole.step(a, g.clone(), out, cfg.lr)
        a = out
        out = torch.empty(numel)
        gs = g.clone()
        for lo, hi, opt in shards:
            opt.step(b[lo:hi], gs[lo:hi], out[lo:hi], cfg.lr)
        b = out
    tol = dict(rtol=0, atol=0) if impl in ("unfused", "native") else dict(rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(b, a, **tol)
    key = "exp_avg_sq" if name == "adam" else "momentum"
    torch.testing.assert_close(torch.cat([opt.state_dict()[key] for _, _, opt in shards]),
                               whole.state_dict()[key], **tol)
