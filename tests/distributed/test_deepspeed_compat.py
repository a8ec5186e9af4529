"""The same DeepSpeed-style script under the real `deepspeed` (its 1F1B-with-flush engine) and under
megatron_2bw with the flush schedule: per-batch losses equal within 1e-5 for 10 batches. Also
DeepSpeed's own PipelineModule / LayerSpec objects, handed to megatron_2bw.initialize unchanged.
Skips when deepspeed is not installed.

Identical initial weights come from the script itself: it seeds torch once, and both packages
build the layers in the same order with the same RNG consumption (partition_method='parameters'
builds every LayerSpec once, then each stage builds its own; the tied copy is broadcast from the
first stage), so nothing is copied between the runs."""
import importlib.util
import os
import sys
import tempfile
import types

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples", "deepspeed_style"))

import train as example  # noqa: E402
from megatron_2bw.training.spawn import spawn  # noqa: E402

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="deepspeed is not installed")
ARGV = ["--steps", "10", "--schedule", "flush", "--micro-batch", "2", "--accumulation", "3",
        "--gradient-clipping", "0"]


def _worker(rank, world, outdir):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import importlib

    import deepspeed
    import megatron_2bw
    # DeepSpeed JIT-compiles a shared-memory all-reduce for CPUs on first use (minutes of C++
    # build); gloo carries the same collectives, so the test skips building it.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    out = {"deepspeed": example.run(deepspeed, ARGV, log=lambda _: None),
           "ours": example.run(megatron_2bw, ARGV, log=lambda _: None)}
    # DeepSpeed's PipelineModule (built by deepspeed) trained by our engine
    torch.manual_seed(1234)
    net = example.build_model(deepspeed, 2)
    eng, _, _, _ = megatron_2bw.initialize(model=net, training_data=example.token_dataset(),
                                           config=example.ds_config("flush", 2, 3, clipping=0.0))
    out["ds_module"] = [float(eng.train_batch()) for _ in range(10)]
    # our PipelineModule over DeepSpeed's LayerSpec / TiedLayerSpec objects
    hybrid = types.SimpleNamespace(pipe=types.SimpleNamespace(
        LayerSpec=deepspeed.pipe.LayerSpec, TiedLayerSpec=deepspeed.pipe.TiedLayerSpec,
        PipelineModule=megatron_2bw.deepspeed.pipe.PipelineModule))
    torch.manual_seed(1234)
    net = example.build_model(hybrid, 2)
    eng, _, _, _ = megatron_2bw.initialize(model=net, training_data=example.token_dataset(),
                                           config=example.ds_config("flush", 2, 3, clipping=0.0))
    out["ds_specs"] = [float(eng.train_batch()) for _ in range(10)]
    torch.save(out, os.path.join(outdir, f"{rank}.pt"))


def test_same_script_same_losses_as_deepspeed_flush():
    with tempfile.TemporaryDirectory() as d:
        spawn(_worker, 2, args=(d,), timeout_minutes=3)
        res = [torch.load(os.path.join(d, f"{r}.pt")) for r in range(2)]
    ref = res[0]["deepspeed"]
    assert len(ref) == 10
    for r in res:
        assert r["deepspeed"] == ref  # DeepSpeed broadcasts the loss to every stage; so do we
        for key in ("ours", "ds_module", "ds_specs"):
            assert r[key] == pytest.approx(ref, abs=1e-5), key
