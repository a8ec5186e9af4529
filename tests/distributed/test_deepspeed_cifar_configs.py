"""The CIFAR-style training DeepSpeed's pipeline tests run, with the config they write
(train_batch_size 16, micro-batch 4, Adam with weight decay, ZeRO stage 0, fp16 off,
"pipeline": {"seed_layers": true, "activation_checkpoint_interval": 1}), on 4 gloo processes
over the topologies they use (1x4, 2x2, 4x1 pipe x data): flush equals plain single-process
training, and 2bw equals the delayed-update reference (W(t+1) = step(W(t), g(W(t-1)))), both
per batch to 1e-5 in fp32. The model is examples/deepspeed_style/cifar_pipeline.py's."""
import copy
import os
import sys
import tempfile

import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples", "deepspeed_style"))

from megatron_2bw.training.spawn import spawn  # noqa: E402

TOPOLOGIES = [(1, 4), (2, 2), (4, 1)]
STEPS, BATCH, MICRO = 3, 16, 4
CONFIG = {"train_batch_size": BATCH, "train_micro_batch_size_per_gpu": MICRO,
          "steps_per_print": 20,
          "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.9, 0.999],
                                                   "eps": 1e-8, "weight_decay": 3e-7}},
          "zero_optimization": {"stage": 0}, "fp16": {"enabled": False},
          "pipeline": {"seed_layers": True, "activation_checkpoint_interval": 1}}


def _model():
    import cifar_pipeline as example
    torch.manual_seed(0)
    return example.join_layers(*example.small_alexnet())


def _worker(rank, world, outdir):
    import cifar_pipeline as example
    import megatron_2bw as deepspeed
    from megatron_2bw.deepspeed.pipe import PipeDataParallelTopology
    out = {}
    for pp, dp in TOPOLOGIES:
        for schedule in ("flush", "2bw"):
            net = deepspeed.pipe.PipelineModule(
                layers=_model(), topology=PipeDataParallelTopology(num_pp=pp, num_dp=dp),
                loss_fn=nn.CrossEntropyLoss(), partition_method="parameters")
            config = copy.deepcopy(CONFIG)
            config["pipeline"]["schedule"] = schedule
            eng, _, _, _ = deepspeed.initialize(model=net, config=config,
                                                training_data=example.SyntheticCIFAR())
            out[(pp, dp, schedule)] = [float(eng.train_batch()) for _ in range(STEPS)]
    if rank == 0:   # here: the example imports the drop-in's `deepspeed` name
        out["sync"], out["delayed"] = _reference(False), _reference(True)
    torch.save(out, os.path.join(outdir, f"{rank}.pt"))


def _reference(delayed: bool) -> list:
    """Single-process training on the same batches: the sample order a data-parallel sampler
    gives does not change a batch's mean gradient (every micro-batch has 4 samples)."""
    import cifar_pipeline as example
    data = example.SyntheticCIFAR()
    model = nn.Sequential(*[m if isinstance(m, nn.Module) else _Lambda(m) for m in _model()])
    opt = torch.optim.AdamW(model.parameters(), lr=0.001, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=3e-7)
    prev, losses = copy.deepcopy(model), []
    for t in range(STEPS):
        x, y = data.images[t * BATCH:(t + 1) * BATCH], data.labels[t * BATCH:(t + 1) * BATCH]
        on = prev if delayed and t > 0 else model     # 2bw: the gradient of W(t-1)
        on.zero_grad()
        loss = nn.functional.cross_entropy(on(x), y)
        loss.backward()
        losses.append(loss.item())
        grads = [p.grad.clone() for p in on.parameters()]
        prev = copy.deepcopy(model)                   # W(t), the next batch's W(t-1)
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        opt.step()
    return losses


class _Lambda(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def test_cifar_configs_flush_and_2bw_over_deepspeeds_topologies():
    with tempfile.TemporaryDirectory() as d:
        spawn(_worker, 4, args=(d,), timeout_minutes=3)
        res = [torch.load(os.path.join(d, f"{r}.pt")) for r in range(4)]
    sync, delayed = res[0]["sync"], res[0]["delayed"]
    for r in res:
        for pp, dp in TOPOLOGIES:
            flush, twobw = r[(pp, dp, "flush")], r[(pp, dp, "2bw")]
            assert torch.allclose(torch.tensor(flush), torch.tensor(sync), rtol=1e-5), (pp, dp)
            assert torch.allclose(torch.tensor(twobw), torch.tensor(delayed), rtol=1e-5), \
                (pp, dp)
    assert sync[1:] != delayed[1:]   # the two references differ: the check can tell them apart
