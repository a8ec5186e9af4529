"""Shared helpers of the bench scripts: the layer stacks every peer trains, their data, a spawner
that runs one measured run on d fresh processes (with a timeout, logs to files, errors returned as
text), memory probes and table printing.

Every layer is built under its own seed (base seed + layer index) *inside its constructor*, so the
same layer gets the same initial weights whoever builds it (our StageModule, DeepSpeed's
PipelineModule, a torch.distributed.pipelining stage, the single-process reference).
"""
from __future__ import annotations

import json
import math
import os
import resource
import statistics
import sys
import tempfile
import time
import traceback

import torch
import torch.nn.functional as F
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from examples.deepspeed_style.train import Block as GPTBlock  # noqa: E402

STACKS = ("transformer", "mlp")


# ---- the layer stacks ---------------------------------------------------------------------------


class Block(GPTBlock):
    """The GPT block of examples/deepspeed_style/train.py (pre-norm causal self-attention + 4h
    MLP, [b, s, h] -> [b, s, h]), built under seed + index."""

    def __init__(self, index: int, hidden: int, heads: int, seed: int = 1234):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + index)
            super().__init__(hidden, heads)


class ResMLP(nn.Module):
    """Pre-norm residual MLP block: x + fc2(gelu(fc1(ln(x)))), 4h wide."""

    def __init__(self, index: int, hidden: int, heads: int = 1, seed: int = 1234):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + index)
            super().__init__()
            self.ln = nn.LayerNorm(hidden)
            self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


LAYERS = {"transformer": Block, "mlp": ResMLP}


def build_layer(stack: str, index: int, hidden: int, heads: int, seed: int = 1234) -> nn.Module:
    return LAYERS[stack](index, hidden, heads, seed)


def loss_fn(out, target):
    return F.mse_loss(out, target)


def partition(num_layers: int, d: int) -> list[int]:
    base, extra = divmod(num_layers, d)
    bounds = [0]
    for s in range(d):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return bounds


def microbatch(k: int, b: int, s: int, h: int, seed: int = 0):
    """Microbatch k (global index): (input, regression target), deterministic."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + k)
    x = torch.randn(b, s, h, generator=g)
    y = torch.randn(b, s, h, generator=g)
    return x, y


def microbatches(n: int, b: int, s: int, h: int, seed: int = 0) -> list:
    return [microbatch(k, b, s, h, seed) for k in range(n)]


# ---- processes ----------------------------------------------------------------------------------


class RunError(RuntimeError):
    """A run failed or timed out; str() is one line."""


def _worker(rank, world, port, outdir, fn, args, threads):
    log = open(os.path.join(outdir, f"log.{rank}"), "w")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world),
                      OMP_NUM_THREADS=str(threads))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(threads)
    result = {}
    try:
        # every run, one rank too, joins the parent's store: MASTER_PORT names a port the
        # parent holds, so a later env:// rendezvous (a DeepSpeed-style initialize) would fail
        from megatron_2bw.parallel.distributed import init_process_group
        from megatron_2bw.training.spawn import connect_store
        init_process_group(rank, world, "gloo", timeout_minutes=5,
                           store=connect_store(port, world, 5))
        result = {"ok": fn(rank, world, *args)}
    except BaseException as e:  # noqa: BLE001 - reported to the parent as text
        traceback.print_exc()
        result = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                  "time": time.time()}  # the earliest error is the cause, later ones follow
    finally:
        with open(os.path.join(outdir, f"result.{rank}.json"), "w") as f:
            json.dump(result, f)
        sys.stdout.flush()
        try:
            if "error" not in result:
                from megatron_2bw.parallel.distributed import destroy_process_group
                destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    os._exit(0)


_CTX = None


def _context():
    """A forkserver that has imported torch once: every run starts from a fresh fork of it (a
    new process, no threads, nothing run yet) instead of re-importing torch for seconds."""
    global _CTX
    if _CTX is None:
        import multiprocessing as mp
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "torch.nn.functional",
                                     "torch._dynamo"])  # torch.optim imports it lazily
    return _CTX


def run_spawned(fn, world: int, args: tuple = (), timeout: float = 600.0, threads: int = 1,
                keep_logs: str | None = None) -> list:
    """fn(rank, world, *args) on `world` fresh processes (gloo, `threads` threads each); returns
    the per-rank results (JSON-able). Raises RunError (one line, the first failing rank's error,
    or a timeout) and kills the processes when a rank fails or hangs."""
    ctx = _context()
    outdir = tempfile.mkdtemp(prefix="bench_")
    from megatron_2bw.training.spawn import host_store
    store = host_store(world, 5)  # held until the ranks have exited
    procs = [ctx.Process(target=_worker, args=(r, world, store.port, outdir, fn, args, threads))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.time() + timeout
    error = None
    try:
        while any(p.is_alive() for p in procs):
            if _errors(outdir, world) or time.time() > deadline:
                break
            time.sleep(0.05)
        if _errors(outdir, world):
            time.sleep(0.5)  # let the other ranks report what followed
            first = min(_errors(outdir, world), key=lambda x: x[0])
            error = f"rank {first[1]}: {first[2]}"
        elif time.time() > deadline:
            error = f"timed out after {timeout:.0f} s"
    finally:
        if error:
            time.sleep(0.5)
            for p in procs:
                if p.is_alive():
                    p.kill()
        for p in procs:
            p.join(5)
    results = []
    for r in range(world):
        path = os.path.join(outdir, f"result.{r}.json")
        res = {}
        if os.path.exists(path):
            with open(path) as f:
                res = json.load(f)
        if error is None and "ok" not in res:
            error = f"rank {r}: {res.get('error', 'exited without a result')}"
        results.append(res.get("ok"))
    if keep_logs:
        os.makedirs(keep_logs, exist_ok=True)
        for r in range(world):
            src = os.path.join(outdir, f"log.{r}")
            if os.path.exists(src):
                os.replace(src, os.path.join(keep_logs, f"log.{r}"))
    if error:
        raise RunError(f"{error} (logs: {outdir})")
    _rmtree(outdir)
    return results


def _errors(outdir: str, world: int) -> list:
    """[(time, rank, message)] of the ranks that reported an error so far."""
    out = []
    for r in range(world):
        path = os.path.join(outdir, f"result.{r}.json")
        if os.path.exists(path):
            try:
                with open(path) as f:
                    res = json.load(f)
            except ValueError:
                continue
            if "error" in res:
                out.append((res.get("time", 0.0), r, res["error"]))
    return out


def _rmtree(path):
    import shutil
    shutil.rmtree(path, ignore_errors=True)


# ---- memory -------------------------------------------------------------------------------------


def rss_bytes() -> int:
    """Current resident set size of this process."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS counter (VmHWM) of this process (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Peak RSS since the last reset_peak_rss() (VmHWM), else since the process started."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def framework_warmup() -> None:
    """Run every kind of op the benches use once on a tiny model (autograd, attention, Adam,
    a collective), so lazy imports and one-time framework buffers land in the baseline RSS and
    not in a run's peak."""
    from megatron_2bw.parallel.comm import Comm
    net = nn.Sequential(Block(0, 8, 2), ResMLP(1, 8))
    opt = torch.optim.Adam(net.parameters())
    loss_fn(net(torch.randn(2, 4, 8)), torch.randn(2, 4, 8)).backward()
    opt.step()
    opt.zero_grad()
    Comm().barrier()


class MemoryProbe:
    """Peak RSS above the RSS at construction (the baseline after imports)."""

    def __init__(self):
        self.baseline = rss_bytes()
        self.reset = reset_peak_rss()

    def result(self) -> dict:
        peak = peak_rss_bytes()
        return {"peak_rss": peak, "baseline_rss": self.baseline,
                "peak_above_baseline": max(peak - self.baseline, 0) if self.reset else None}


# ---- numbers and tables -------------------------------------------------------------------------


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def median_interval(xs, level: float = 0.95):
    """A distribution-free interval for the median of `xs` (independent draws): the order
    statistics (x_(k), x_(n+1-k)) with the largest k whose binomial(n, 1/2) tail leaves at least
    `level` between them; None when n is too small for `level` (n < 6 at 95%)."""
    xs = sorted(x for x in xs if x is not None)
    n, k = len(xs), 0
    tail = lambda j: sum(math.comb(n, i) for i in range(j)) / 2 ** n  # noqa: E731  P(B < j)
    while k + 1 <= n // 2 and 1 - 2 * tail(k + 1) >= level:
        k += 1
    return (xs[k - 1], xs[n - k]) if k else None


# ---- paired runs: out = {run name: {"samples_per_s_runs": [per repeat], "samples_per_s": median}}

def with_interval(v: float, interval) -> str:
    if interval is None:
        return f"{v:.3f}"
    return f"{v:.3f} (95% interval of the median {interval[0]:.3f}-{interval[1]:.3f})"


def _pair_ratios(out: dict, a: str, b: str) -> list | None:
    """a's samples/s over b's, repeat by repeat, when both ran every repeat (interleaved, so
    each pair shares the machine's state of the moment); None otherwise."""
    ra, rb = (out[n].get("samples_per_s_runs") or [] for n in (a, b))
    return [x / y for x, y in zip(ra, rb)] if ra and len(ra) == len(rb) else None


def paired(out: dict, a: str, b: str) -> float:
    """a's samples/s over b's: the median of the per-repeat ratios (`_pair_ratios`), else of
    the medians."""
    ratios = _pair_ratios(out, a, b)
    return median(ratios) if ratios else out[a]["samples_per_s"] / out[b]["samples_per_s"]


def paired_interval(out: dict, a: str, b: str):
    """The distribution-free 95% interval of `paired`'s median (`median_interval` over the
    per-repeat ratios; the repeats are interleaved and rotated, so the pairs are taken as
    independent): None without pairs or with fewer than 6 of them. A target is read as met on
    the median; the interval says whether the machine's spread lets the run tell."""
    ratios = _pair_ratios(out, a, b)
    return median_interval(ratios) if ratios else None


def mb(nbytes) -> str:
    return "-" if nbytes is None else f"{nbytes / 2 ** 20:.1f}"


def table(headers: list, rows: list) -> str:
    """A Markdown table (aligned, so it also reads well in a terminal)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    fmt = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    return "\n".join([fmt(cells[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] +
                     [fmt(r) for r in cells[1:]])


def stamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M %Z")


def command_line() -> str:
    import shlex
    return "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], ROOT)]
                                + sys.argv[1:])


def write_json(path: str, data) -> None:
    if path == "-":
        json.dump(data, sys.stdout, indent=1)
        print()
        return
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
