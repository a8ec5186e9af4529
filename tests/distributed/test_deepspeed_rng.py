"""Dropout in the DeepSpeed drop-in draws as DeepSpeed's engine does: from each process's own
generator (whatever the script seeded), in forward order, with no reseeding per microbatch. A
one-process replay that keeps one generator state per stage and runs the microbatches in order
gives the same losses (flush, 2 stages, 2 batches of 2 microbatches, per batch to 1e-5)."""
import os
import tempfile

import torch
from torch import nn

import megatron_2bw as deepspeed
from megatron_2bw.training.spawn import spawn

CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "eps": 1e-8}},
          "steps_per_print": 100, "pipeline": {"schedule": "flush"}}
BATCHES, MICRO = 2, 2


def _layers():
    torch.manual_seed(0)
    return [nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 16), nn.Dropout(0.5),
            nn.Linear(16, 4)]


def _data():
    g = torch.Generator().manual_seed(3)     # its own generator: the process's is untouched
    return [(torch.randn(2, 8, generator=g), torch.randint(0, 4, (2,), generator=g))
            for _ in range(BATCHES * MICRO)]


def _worker(rank, world, outdir):
    layers = _layers()
    net = deepspeed.pipe.PipelineModule(layers=layers, num_stages=2, loss_fn=nn.CrossEntropyLoss(),
                                        partition_method="uniform")
    eng, _, _, _ = deepspeed.initialize(model=net, config=CONFIG)
    torch.manual_seed(100 + rank)             # the script's seed, different on each stage
    data = iter(_data())
    losses = [float(eng.train_batch(data)) for _ in range(BATCHES)]
    torch.save({"losses": losses, "parts": list(net.parts)}, os.path.join(outdir, f"{rank}.pt"))


def _replay(parts: list[int]) -> list[float]:
    model = nn.Sequential(*_layers())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-8)
    states = []
    for stage in range(2):
        torch.manual_seed(100 + stage)
        states.append(torch.get_rng_state())
    data, losses = iter(_data()), []
    for _ in range(BATCHES):
        total = 0.0
        for _ in range(MICRO):
            x, y = next(data)
            for stage in range(2):
                torch.set_rng_state(states[stage])
                for layer in model[parts[stage]:parts[stage + 1]]:
                    x = layer(x)
                states[stage] = torch.get_rng_state()
            loss = nn.functional.cross_entropy(x, y) / MICRO
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def test_dropout_draws_from_each_stages_own_generator_in_forward_order():
    with tempfile.TemporaryDirectory() as d:
        spawn(_worker, 2, args=(d,), timeout_minutes=2)
        res = [torch.load(os.path.join(d, f"{r}.pt")) for r in range(2)]
    parts = res[0]["parts"]
    assert parts[0] == 0 and parts[-1] == 5 and 0 < parts[1] < 5
    assert all(abs(a - b) < 1e-5 for a, b in zip(res[0]["losses"], res[1]["losses"]))
    want = _replay(parts)
    assert all(abs(a - b) < 1e-5 for a, b in zip(res[0]["losses"], want)), (res[0], want)
    # one generator for the whole model (as in one process) gives another run
    assert any(abs(a - b) > 1e-3 for a, b in zip(res[0]["losses"], _replay([0, 5, 5])))
