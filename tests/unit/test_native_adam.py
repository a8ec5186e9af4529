"""The native CPU AdamW kernel (optim/native.py): built once per machine, checked, run when asked
for (`--optimizer-impl native`, OptimizerConfig.impl; never the default); its step with the 2BW
prediction in the same pass writes the bits a later recomputation from the state writes (views,
resumes, loads); any split of a range (chunks, threads) changes no bit; bf16 rounding is torch's;
without a compiler there is no library (asking for it: tests/unit/test_optimizer_impl.py)."""
import os
import struct

import pytest
import torch

from megatron_2bw.config import OptimizerConfig
from megatron_2bw.optim import native
from megatron_2bw.optim import optimizer as O
from megatron_2bw.training.build import mock_batches

LIB = native.library()
pytestmark = pytest.mark.skipif(LIB is None, reason="no C compiler to build the native kernel")
CFG = OptimizerConfig(lr=1e-2, weight_decay=0.1, adam_beta2=0.95, impl="native")
METHODS = {"predict": (False, False), "predict-nesterov": (True, False),
           "predict-spike": (False, True)}


def _state(n=1001, steps=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen), [torch.randn(n, generator=gen) for _ in range(steps)]


def test_native_runs_when_asked_for_and_never_by_default():
    assert O.make_optimizer(CFG, 10, 5, "cpu").impl == "native"  # the config asks
    assert O.make_optimizer(OptimizerConfig(), 10, 5, "cpu", impl="native").impl == "native"
    assert O.make_optimizer(OptimizerConfig(), 10, 5, "cpu").impl != "native"
    assert O.make_optimizer(OptimizerConfig(name="sgd"), 10, 5, "cpu").impl != "native"
    with pytest.raises(ValueError, match="--optimizer-impl native is an Adam kernel"):
        O.make_optimizer(OptimizerConfig(name="sgd"), 10, 5, "cpu", impl="native")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("method", METHODS)
def test_the_step_writes_the_prediction_a_recomputation_from_the_state_writes(method, dtype):
    nesterov, spike = METHODS[method]
    p0, grads = _state()
    runs = []
    for fused in (True, False):
        opt = O.make_optimizer(CFG, p0.numel(), 700, "cpu", keep_grad=True)
        w, pred = p0.clone(), torch.empty(p0.numel(), dtype=dtype)
        for i, g in enumerate(grads):
            lr, nxt = 1e-2 * (i + 1), 1e-2 * (i + 2)
            if fused:
                opt.step(w, g, w, lr, predict=(pred, nxt, nesterov, spike))
            else:  # the deferred path's pieces: the step, then the prediction in chunks
                opt.step(w, g, w, lr)
                opt.predict(w, pred, nxt, nesterov=nesterov, spike=(g, lr) if spike else None)
        runs.append((w.clone(), pred.clone(), {k: v.clone() if torch.is_tensor(v) else v
                                               for k, v in opt.state_dict().items()}))
        again = torch.empty_like(pred)  # a view or a resume: from master and state alone
        opt.predict(w, again, nxt, nesterov=nesterov)
        assert torch.equal(again, pred)
        assert not torch.equal(pred.float(), w)
    (w1, p1, s1), (w2, p2, s2) = runs
    assert torch.equal(w1, w2) and torch.equal(p1, p2)
    assert all(torch.equal(s1[k], s2[k]) if torch.is_tensor(s1[k]) else s1[k] == s2[k]
               for k in s1)


def test_the_step_and_prediction_follow_the_torch_kernels():
    """The native arithmetic rounds differently from torch's fused kernel and from the torch
    ops of the prediction, by a few fp32 ulps."""
    p0, grads = _state(steps=5)
    out = {}
    for impl in ("native", "torch-fused" if O._torch_fused_works(torch.device("cpu"), "adam")
                 else "unfused"):
        opt = O.make_optimizer(CFG, p0.numel(), 700, "cpu", impl=impl, keep_grad=True)
        src, dst = p0.clone(), torch.empty(p0.numel())
        for g in grads:
            opt.step(src, g, dst, 1e-2)
            src.copy_(dst)
        preds = []
        for nesterov in (False, True):
            preds.append(torch.empty(p0.numel()))
            opt.predict(src, preds[-1], 2e-2, nesterov=nesterov)
        out[impl] = [src, opt.exp_avg, opt.exp_avg_sq, *preds]
    for a, b in zip(*out.values()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_any_split_of_the_range_changes_no_bit(monkeypatch):
    """Ranges cut anywhere (a shard, a chunk, a thread's part) give the whole range's bits."""
    n = native.SPLIT_ELEMENTS + 37
    p0, (g,) = _state(n, 1)
    m0, v0 = g * 0.1, g * g * 0.01
    k = native.coefficients(0.9, 0.95, 1e-8, 4, 1e-2, 0.1, pred_lr=2e-2, spike_lr=1e-2)
    outs = []
    for cuts, threads in (([0, n], 1), ([0, 13, 1000, n], 1), ([0, n], 3)):
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
        p, m, v = p0.clone(), m0.clone(), v0.clone()
        keep, pred = torch.empty(n), torch.empty(n, dtype=torch.bfloat16)
        for a, b in zip(cuts, cuts[1:]):
            native.adamw_step(LIB, p[a:b], p[a:b], g[a:b], m[a:b], v[a:b], k, keep[a:b],
                              pred[a:b], spike=True, nesterov=True)
        outs.append((p, m, v, keep, pred))
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other))
    assert torch.equal(outs[0][3], g)
    assert native._POOL  # the threaded call made the pool; a forked child starts without it
    pid = os.fork()
    if pid == 0:
        os._exit(0 if not native._POOL else 1)
    assert os.waitpid(pid, 0)[1] == 0


def test_bf16_rounding_is_torch_s():
    """m = 0 and lr' = 0 make the prediction the weights themselves, rounded to bf16."""
    bits = [0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00001,
            0xFFA00000, 0x00000001, 0x80008000, 0x007FFFFF, 0x00000000, 0x80000000, 0x4049FFFF]
    special = torch.tensor([struct.unpack("<f", struct.pack("<I", b))[0] for b in bits])
    p = torch.cat([special, torch.randn(4000) * 10.0 ** torch.randint(-30, 30, (4000,))])
    n = p.numel()
    m, v, pred = torch.zeros(n), torch.ones(n), torch.empty(n, dtype=torch.bfloat16)
    native.adamw_predict(LIB, p, m, v, pred,
                         native.coefficients(0.9, 0.95, 1e-8, 2, 0.0, 0.0))
    want = p.to(torch.bfloat16)
    real = ~want.isnan()
    assert torch.equal(pred.view(torch.int16)[real], want.view(torch.int16)[real])
    assert torch.equal(pred.isnan(), want.isnan())


def test_without_a_compiler_there_is_no_library(tmp_path):
    assert native.library(compiler=str(tmp_path / "no-such-cc"), cache_dir=str(tmp_path)) is None
    assert native.library(compiler="false", cache_dir=str(tmp_path)) is None  # the build fails
    assert list(tmp_path.iterdir()) == []  # no half-built library left behind
    built = native.library(compiler=native.shutil.which("cc") or "gcc", cache_dir=str(tmp_path))
    assert built is not None and [f.suffix for f in tmp_path.iterdir()] == [".so"]


def test_a_compensated_engine_predicts_in_the_step_and_follows_the_torch_kernels():
    from test_compensation_deferred import _engine
    engines = {}
    for kernel, impl in (("native", "native"), ("torch", "auto")):
        engines[kernel], cfg = _engine("predict-nesterov", impl)
    assert engines["native"].stepper.optimizer.impl == "native"
    assert engines["torch"].stepper.optimizer.impl != "native"
    native_comp = engines["native"].stepper.compensation
    assert native_comp.fused and not native_comp.defer
    assert not engines["torch"].stepper.compensation.fused
    feeds = [mock_batches(cfg, 1, 0) for _ in range(2)]
    for t in range(6):
        a, b = (e.train_batch(f) for e, f in zip(engines.values(), feeds))
        torch.testing.assert_close(a, b, rtol=1e-5, atol=0)
        assert native_comp.job is None  # nothing left pending
    mine, theirs = (e.module.state_dict() for e in engines.values())
    for key in theirs:
        torch.testing.assert_close(mine[key], theirs[key], rtol=1e-5, atol=1e-6)
