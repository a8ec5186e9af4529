"""The planner's memory model counts exactly what the engine holds: weight versions, master
weights, gradient buffers and optimizer state byte for byte, the number of stashed microbatches at
peak, and (within 2%) the activation bytes autograd keeps per microbatch. Real engines on 1 and 2
gloo processes, instrumented from the outside (a subclass), trained for three batches."""
import json
import os
import tempfile

import pytest
import torch

from megatron_2bw.config import BatchConfig, Config, ModelConfig, OptimizerConfig, ParallelConfig
from megatron_2bw.config import PrecisionConfig, TrainConfig
from megatron_2bw.planner import AnalyticProfile, Topology
from megatron_2bw.planner.cost_model import LayerTimes, Layout, Setup, activation_bytes, stage_plan
from megatron_2bw.training.spawn import spawn

BATCHES = 3


def _cfg(schedule, t=1, d=1, b=2, m=4, dtype="fp32", opt="adam", recompute=False):
    model = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, seq_length=16,
                        vocab_size=128, recompute_method="uniform" if recompute else None,
                        recompute_num_layers=1 if recompute else 0)
    return Config(model=model, parallel=ParallelConfig(tensor=t, pipeline=d, data=1,
                                                       backend="gloo"),
                  batch=BatchConfig(b, b * m), optimizer=OptimizerConfig(name=opt),
                  precision=PrecisionConfig(dtype=dtype), train=TrainConfig(train_iters=BATCHES),
                  schedule=schedule).validate(t * d)


def _worker(rank, world_size, cfgs, outdir):
    from megatron_2bw.parallel.grid import ProcessGrid
    from megatron_2bw.pipeline.engine import PipelineEngine
    from megatron_2bw.tensor_parallel import TPGroup
    from megatron_2bw.training.build import mock_batches
    from megatron_2bw.models.families import model_parts

    class Counting(PipelineEngine):
        """Counts stashed microbatches and the bytes autograd saves per forward."""

        def _forward(self, a):
            skip = {t.untyped_storage().data_ptr() for t in self.weights.slots}
            saved = {}

            def pack(x):
                ptr = x.untyped_storage().data_ptr()
                if ptr not in skip:
                    saved[(ptr, x.storage_offset(), tuple(x.shape), x.dtype)] = \
                        x.numel() * x.element_size()
                return x
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
                super()._forward(a)
            self.peak = max(getattr(self, "peak", 0), len(self.outputs))
            self.act = max(getattr(self, "act", 0), sum(saved.values()))

    results = []
    for cfg in cfgs:
        grid = ProcessGrid.from_config(cfg, rank, world_size).init_groups()
        specs, loss_fn, bounds = model_parts(cfg, TPGroup.from_grid(grid), grid.pipeline)
        engine = Counting(cfg, grid, specs, loss_fn, bounds, "cpu")
        data = mock_batches(cfg, grid.data, grid.dp_rank)
        engine.start(BATCHES)
        for _ in range(BATCHES):
            engine.train_batch(data)
        w = engine.weights
        nbytes = lambda ts: sum(x.numel() * x.element_size() for x in ts if x is not None)  # noqa
        opt_state = [v for v in engine.stepper.optimizer.state_dict().values()
                     if isinstance(v, torch.Tensor)]
        results.append({"stage": grid.stage, "bounds": bounds, "numel": w.numel,
                        "versions": len(w.slots), "peak": engine.peak, "act": engine.act,
                        "memory": {"weights": nbytes(w.slots), "master": nbytes([w.master]),
                                   "grads": nbytes(w.grads), "model_grad": nbytes([w.model_grad]),
                                   "optimizer": nbytes(opt_state)}})
        torch.distributed.barrier()
    with open(os.path.join(outdir, f"{rank}.json"), "w") as f:
        json.dump(results, f)


def _run(cfgs, world):
    with tempfile.TemporaryDirectory() as d:
        spawn(_worker, world, args=(cfgs, d), timeout_minutes=2)
        per_rank = [json.load(open(os.path.join(d, f"{r}.json"))) for r in range(world)]
    return [[per_rank[r][i] for r in range(world)] for i in range(len(cfgs))]


def _check(cfg, ranks):
    L = Layout(cfg.schedule, cfg.parallel.tensor, cfg.parallel.pipeline, 1,
               cfg.batch.micro_batch_size, cfg.num_microbatches,
               cfg.model.recompute_method is not None)
    setup = Setup(cfg.model, cfg.precision.dtype, cfg.optimizer.name)
    topo = Topology()
    times = LayerTimes(setup, AnalyticProfile(), topo)
    plan = stage_plan(setup, L, times, topo, bounds=ranks[0]["bounds"])
    costs = times.get(L.micro_batch, L.tensor)[0]
    for r in ranks:
        s = r["stage"]
        mem = plan.memory[s]
        what = f"{L.describe()} {cfg.precision.dtype} {cfg.optimizer.name} stage {s}"
        assert r["versions"] == (2 if cfg.schedule == "2bw" else 1), what
        assert r["peak"] == plan.peak_in_flight[s], what
        assert {k: mem[k] for k in r["memory"]} == r["memory"], what
        lo, hi = plan.bounds[s], plan.bounds[s + 1]
        per_mb, _ = activation_bytes(costs, lo, hi, L.recompute, s == L.pipeline - 1)
        out = 0 if s == L.pipeline - 1 else costs[hi - 1].output_bytes  # held, not saved
        assert r["act"] == pytest.approx(per_mb - out, rel=0.02), what


def test_memory_model_equals_engine_one_process():
    cfgs = [_cfg("2bw", m=2), _cfg("flush", dtype="bf16", opt="sgd"), _cfg("gpipe", m=3),
            _cfg("gpipe", m=3, recompute=True)]
    for cfg, ranks in zip(cfgs, _run(cfgs, 1)):
        _check(cfg, ranks)


def test_memory_model_equals_engine_two_stages():
    cfgs = [_cfg("2bw", d=2, m=4), _cfg("flush", d=2, m=4, dtype="bf16"),
            _cfg("gpipe", d=2, m=4, opt="sgd"), _cfg("2bw", d=2, m=3, recompute=True),
            _cfg("flush", t=2, m=2)]
    for cfg, ranks in zip(cfgs, _run(cfgs, 2)):
        _check(cfg, ranks)
