"""eval_batch as DeepSpeed returns it: without a loss function (or with compute_loss=False) the
last stage's outputs, reduce_output "avg" (mean over microbatches and data-parallel replicas) or
None (the list), broadcast to every stage with compute_loss and bcast_loss; a sequential module
with and without activation checkpointing gives the plain module's outputs."""
import copy
import os
import tempfile

import torch
from torch import nn

import megatron_2bw as deepspeed
from megatron_2bw.training.spawn import spawn

HIDDEN = 16


def _save(obj, outdir, rank):
    torch.save(obj, os.path.join(outdir, f"{rank}.pt"))


def _load(outdir, world):
    return [torch.load(os.path.join(outdir, f"{r}.pt"), weights_only=False) for r in range(world)]


def _config(micro=1, accumulation=1, interval=0):
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": accumulation,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}, "steps_per_print": 100,
            "pipeline": {"schedule": "flush", "activation_checkpoint_interval": interval}}


def _sequential_worker(rank, world, outdir):
    out = {}
    for interval in (0, 1):
        torch.manual_seed(0)
        base = nn.Sequential(*[nn.Linear(HIDDEN, HIDDEN) for _ in range(4)], nn.Linear(HIDDEN, 1))
        x = torch.randn(1, HIDDEN)
        with torch.no_grad():
            want = base(x)
        net = deepspeed.pipe.PipelineModule(layers=copy.deepcopy(base), num_stages=2)
        mine = torch.tensor([float(sum(p.numel() for p in net.parameters()))])
        deepspeed.comm.all_reduce(mine)
        eng, _, _, _ = deepspeed.initialize(model=net, config=_config(interval=interval))
        got = eng.eval_batch(iter([(x, 0)]))
        out[interval] = {"want": want, "got": got, "params": mine.item(),
                         "base_params": sum(p.numel() for p in base.parameters())}
    _save(out, outdir, rank)


def test_sequential_module_outputs_with_and_without_checkpointing():
    with tempfile.TemporaryDirectory() as d:
        spawn(_sequential_worker, 2, args=(d,), timeout_minutes=2)
        res = _load(d, 2)
    for r in res:   # both stages: the last stage's outputs, broadcast as DeepSpeed does
        for interval in (0, 1):
            case = r[interval]
            assert case["params"] == case["base_params"]
            assert case["got"].dtype == torch.float32
            assert torch.allclose(case["got"].reshape(-1), case["want"].reshape(-1), atol=1e-6)
            assert case["got"].shape == case["want"].shape


def _reduce_worker(rank, world, outdir):
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8), nn.Linear(8, 1)]
    ref = copy.deepcopy(nn.Sequential(*layers))
    net = deepspeed.pipe.PipelineModule(layers=layers, num_stages=1, loss_fn=nn.MSELoss())
    eng, _, _, _ = deepspeed.initialize(model=net, config=_config(micro=2, accumulation=3))
    torch.manual_seed(10 + rank)                  # each replica its own data
    data = [(torch.randn(2, 8), torch.randn(2, 1)) for _ in range(3)]
    with torch.no_grad():
        local = [ref(x) for x, _ in data]
        local_loss = sum(nn.functional.mse_loss(ref(x), y) for x, y in data) / 3
    _save({"local": local, "local_loss": local_loss,
           "avg": eng.eval_batch(iter(data), compute_loss=False),
           "list": eng.eval_batch(iter(data), compute_loss=False, reduce_output=None),
           "loss": eng.eval_batch(iter(data)),
           "logits": eng.eval_batch(iter(data), return_logits=True)}, outdir, rank)


def test_compute_loss_false_and_reduce_output_meanings_over_replicas():
    with tempfile.TemporaryDirectory() as d:
        spawn(_reduce_worker, 2, args=(d,), timeout_minutes=2)   # 1 stage x 2 replicas
        res = _load(d, 2)
    mean = sum(sum(r["local"]) / 3 for r in res) / 2
    mean_loss = sum(r["local_loss"] for r in res) / 2
    for r in res:
        assert torch.allclose(r["avg"], mean, atol=1e-6)    # over microbatches and replicas
        assert len(r["list"]) == 3 and all(torch.allclose(a, b, atol=1e-6)
                                           for a, b in zip(r["list"], r["local"]))
        assert torch.allclose(r["loss"], mean_loss, atol=1e-6)
        loss, logits = r["logits"]
        assert torch.allclose(loss, mean_loss, atol=1e-6)
        assert torch.allclose(logits, r["local"][-1], atol=1e-6)


def _smallest_worker(rank, world, outdir):
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8), nn.Linear(8, 1)]
    ref = copy.deepcopy(nn.Sequential(*layers))
    net = deepspeed.pipe.PipelineModule(layers=layers, num_stages=1)
    eng, _, _, _ = deepspeed.initialize(model=net, config=_config())
    x = torch.randn(1, 8)
    _save({"got": eng.eval_batch(iter([(x, 0)])), "want": ref(x).detach(),
           "none": eng.eval_batch(iter([(x, 0)]), bcast_loss=False)}, outdir, rank)


def test_no_loss_fn_returns_the_outputs():
    """The issue's smallest case: a two-layer module on one stage, eval_batch without loss_fn."""
    with tempfile.TemporaryDirectory() as d:
        spawn(_smallest_worker, 1, args=(d,), timeout_minutes=2)
        (r,) = _load(d, 1)
    assert torch.allclose(r["got"], r["want"], atol=1e-6) and r["got"].shape == (1, 1)
    assert torch.allclose(r["none"], r["want"], atol=1e-6)


def _middle_worker(rank, world, outdir):
    torch.manual_seed(0)
    layers = [nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)]
    net = deepspeed.pipe.PipelineModule(layers=copy.deepcopy(layers), num_stages=2,
                                        loss_fn=nn.MSELoss())
    eng, _, _, _ = deepspeed.initialize(model=net, config=_config(micro=1, accumulation=2))
    x = torch.randn(1, 8)
    with torch.no_grad():
        want = nn.Sequential(*layers)(x)
    data = iter([(x, torch.zeros(1, 2))] * 2)
    _save({"stage": eng.stage_id, "want": want,
           "outputs": eng.eval_batch(data, compute_loss=False),
           "bcast": eng.eval_batch(iter([(x, torch.zeros(1, 2))] * 2), compute_loss=True)},
          outdir, rank)


def test_compute_loss_false_leaves_the_outputs_on_the_last_stage():
    with tempfile.TemporaryDirectory() as d:
        spawn(_middle_worker, 2, args=(d,), timeout_minutes=2)
        res = _load(d, 2)
    first, last = sorted(res, key=lambda r: r["stage"])
    assert first["outputs"] is None
    assert torch.allclose(last["outputs"], last["want"], atol=1e-6)
    assert torch.allclose(first["bcast"], last["bcast"]) and first["bcast"].dim() == 0
