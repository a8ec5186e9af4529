"""AdamW's CPU kernel, with 2BW's prediction in the same pass (`impl="native"`, native_adam.c):
opt-in, `--optimizer-impl native` (optim/kernels.py; the default is torch's kernels).

Why. On a CPU torch's fused AdamW is one pass over weights, gradient and moments, but the 2BW
compensation's prediction (pipeline/compensation.py) is more passes of its own over the same
buffers in torch ops (a denominator, a divide, the weight decay), and a 2BW step out of place first
copies the weights. Here one loop reads src, gradient and moments once and writes the new weights,
moments and, when asked, the prediction made from the new state (and the kept gradient of
predict-nesterov): the prediction costs one more written stream, and an out-of-place step no copy.
bench/step_kernels.py, 8.4 M elements, one thread: plain 2BW's step 6.4 ms (torch's kernel and
copy: 9.5), with `predict` 6.6 ms (torch: 15.9).

Build. `library()` compiles native_adam.c with the machine's C compiler (`cc`, else `gcc`; no torch
headers, no Python headers: a plain shared object loaded with ctypes, which releases the GIL during
a call) into the project's cache directory ($MEGATRON_2BW_CACHE, else ~/.cache/megatron_2bw:
data/cache.py owns it; else the temporary directory when that is not writable), named by a hash of
the source and the flags, so a build is done once per machine and shared by every process; a
process writes its own temporary file (data/cache.py's `unique_temp`: host, pid and a random
suffix) and renames it into place (concurrent ranks never see half a library). The source selects
the widest vector unit at load time (gcc's target_clones: avx512f, avx2, baseline), so one build
serves every node of a cluster's shared home. The built library is checked once against the
arithmetic below on a few elements; anything failing (no compiler, a build error, a wrong result)
leaves `library()` None, and `--optimizer-impl native` a one-line error (optim/kernels.py).

Arithmetic, fp32, each operation rounded as written (-ffp-contract=off, no fast math), so the
vector loop and its tail agree and any split of a range gives the same bits; with bias1 = 1 -
b1^k, bias2 = 1 - b2^k after the k-th step:

    m    = m + (g - m) * (1 - b1)              v = v * b2 + (g * g) * (1 - b2)
    ds   = sqrt(v) + eps * sqrt(bias2)          (the denominator, times sqrt(bias2))
    p    = src * (1 - lr * wd) + (m / ds) * (-lr * sqrt(bias2) / bias1)          [AdamW]
    p    = p + ((g - m) / ds) * (-lr * (1 - b1) * sqrt(bias2) / bias1)          [spike]
    mn   = m + (g - m) * (1 - b1) (nesterov; g: the kept gradient), else m
    pred = p * (1 - lr' * wd) + (mn / ds) * (-lr' * sqrt(bias2) / bias1)    [prediction, lr']

which is torch.optim.AdamW's update (rounded differently: relative 1e-7 per step) and the
prediction of optim/optimizer.py's docstring. `adamw_predict` recomputes pred from the saved state
with the same operations, so a prediction written by `adamw_step` and one recomputed after a view,
a resume or a load are the same bits. The prediction is written as fp32 or bf16 (round to nearest
even); fp16 slots take optimizer.py's torch ops.

Threads: a call over n >= 2^20 elements is split into torch.get_num_threads() ranges run on a
thread pool (the split changes no bit); one thread, as the launcher sets, runs it whole.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("native_adam.c")
FLAGS = ("-O3", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared")
KINDS = {torch.float32: 1, torch.bfloat16: 2}  # prediction dtypes the kernel writes
SPLIT_ELEMENTS = 2 ** 20  # a call at least this long uses torch's intra-op thread count


@functools.lru_cache(maxsize=None)
def library(compiler: str | None = None, cache_dir: str | None = None):
    """The loaded kernel (ctypes.CDLL), built on first use; None where it cannot be built or
    fails its check. `compiler`, `cache_dir`: tests pass them (default: cc or gcc, and
    the project's cache directory, `data.cache.user_cache_dir()`, then the temporary
    directory)."""
    from megatron_2bw.fs import unique_temp, user_cache_dir
    cc = compiler or shutil.which("cc") or shutil.which("gcc")
    if cc is None or not SOURCE.is_file():
        return None
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join((cc,) + FLAGS + (platform.machine(),)).encode())
    name = f"native_adam-{key.hexdigest()[:16]}.so"
    dirs = [Path(cache_dir)] if cache_dir else [user_cache_dir(),
                                                Path(tempfile.gettempdir()) / "megatron_2bw"]
    for directory in dirs:
        path = directory / name
        tmp = unique_temp(path)  # a shared home: ranks on other nodes may build at the same time
        try:
            if not path.is_file():
                directory.mkdir(parents=True, exist_ok=True)
                subprocess.run([cc, *FLAGS, "-o", str(tmp), str(SOURCE)], check=True,
                               capture_output=True, timeout=300)
                os.replace(tmp, path)
            lib = _bind(ctypes.CDLL(str(path)))
        except (OSError, subprocess.SubprocessError):
            tmp.unlink(missing_ok=True)
            continue
        return lib if _works(lib) else None
    return None


def _bind(lib):
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.m2bw_adamw_step.argtypes = [p, p, p, p, p, p, p, i, p, i, i, i64]
    lib.m2bw_adamw_step.restype = None
    lib.m2bw_adamw_predict.argtypes = [p, p, p, p, p, p, i, p, i, i, i64]
    lib.m2bw_adamw_predict.restype = None
    return lib


def coefficients(b1: float, b2: float, eps: float, steps: int, lr: float, wd: float,
                 pred_lr: float = 0.0, spike_lr: float = 0.0):
    """The kernel's k[] (native_adam.c) after `steps` steps, as a ctypes float array."""
    bias1, root2 = 1 - b1 ** steps, (1 - b2 ** steps) ** 0.5
    scale = root2 / bias1
    values = (1 - b1, b2, 1 - b2, eps * root2, 1 - lr * wd, -lr * scale,
              -spike_lr * (1 - b1) * scale, 1 - pred_lr * wd, -pred_lr * scale)
    return (ctypes.c_float * 9)(*values)


def _ptr(t: torch.Tensor | None, lo: int) -> int | None:
    return None if t is None else t.data_ptr() + lo * t.element_size()


_POOL: list = []  # the thread pool of large calls, made on first use
os.register_at_fork(after_in_child=_POOL.clear)  # a forked child has none of its threads


def _run(call, n: int) -> None:
    """call(lo, hi) over [0, n), split over torch's intra-op threads when n is large."""
    parts = torch.get_num_threads() if n >= SPLIT_ELEMENTS else 1
    if parts <= 1:
        call(0, n)
        return
    if not _POOL or _POOL[0]._max_workers < parts:
        _POOL[:] = [ThreadPoolExecutor(parts, thread_name_prefix="m2bw-adam")]
    size = (-(-n // parts) + 15) // 16 * 16
    futures = [_POOL[0].submit(call, lo, min(lo + size, n)) for lo in range(0, n, size)]
    for f in futures:
        f.result()


def _check(*tensors) -> None:
    for t in tensors:
        if t is not None and (t.device.type != "cpu" or not t.is_contiguous()):
            raise ValueError("the native AdamW kernel takes contiguous CPU buffers: use "
                             "--optimizer-impl auto for this device")


def adamw_step(lib, src, dst, g, m, v, k, keep=None, pred=None, spike: bool = False,
         nesterov: bool = False) -> None:
    """One AdamW step from src into dst (may be src) with coefficients k, over all of src;
    keep: receives g; pred: the prediction from the new state (fp32 or bf16)."""
    _check(src, dst, g, m, v, keep, pred)
    kind = KINDS[pred.dtype] if pred is not None else 0
    _run(lambda lo, hi: lib.m2bw_adamw_step(
        _ptr(src, lo), _ptr(dst, lo), _ptr(g, lo), _ptr(m, lo), _ptr(v, lo), _ptr(keep, lo),
        _ptr(pred, lo), kind, k, int(spike), int(nesterov), hi - lo), src.numel())


def adamw_predict(lib, src, m, v, pred, k, grad=None, last=None) -> None:
    """pred = the prediction from the current state; grad: the spike's (src += spike first);
    last: the kept gradient (the nesterov form)."""
    _check(src, m, v, pred, grad, last)
    _run(lambda lo, hi: lib.m2bw_adamw_predict(
        _ptr(src, lo), _ptr(grad, lo), _ptr(m, lo), _ptr(v, lo), _ptr(last, lo), _ptr(pred, lo),
        KINDS[pred.dtype], k, int(grad is not None), int(last is not None), hi - lo),
        src.numel())


def _works(lib) -> bool:
    """The built kernel against the arithmetic of the module docstring, in torch ops."""
    gen = torch.Generator().manual_seed(0)
    p, g = torch.randn(37, generator=gen), torch.randn(37, generator=gen)
    m, v = torch.randn(37, generator=gen) * 0.1, torch.rand(37, generator=gen) * 0.1
    want_m = m + (g - m) * 0.1
    want_v = v * 0.95 + (g * g) * 0.05
    k = coefficients(0.9, 0.95, 1e-8, 3, 1e-2, 0.1, pred_lr=2e-2)
    ds = want_v.sqrt() + k[3]
    want_p = p * k[4] + (want_m / ds) * k[5]
    want_pred = want_p * k[7] + (want_m / ds) * k[8]
    dst, pred = torch.empty(37), torch.empty(37)
    adamw_step(lib, p, dst, g, m, v, k, pred=pred)
    return all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in
               ((m, want_m), (v, want_v), (dst, want_p), (pred, want_pred)))


__all__ = ["library", "coefficients", "adamw_step", "adamw_predict", "KINDS"]
