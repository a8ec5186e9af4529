"""ZeRO stage 1 is the distributed optimizer: the optimizer state is really sharded over the
data-parallel replicas, training equals the unsharded run (flush and 2bw), and a checkpoint it
writes loads into a ZeRO-1 or an unsharded engine and continues with the same losses."""
import os
import tempfile

import torch
from torch import nn

import megatron_2bw as deepspeed
from megatron_2bw.training.spawn import spawn


def _engine(schedule, stage):
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)]
    net = deepspeed.pipe.PipelineModule(layers=layers, num_stages=2, loss_fn=nn.MSELoss())
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.01}},
              "gradient_clipping": 1.0, "steps_per_print": 100,
              "zero_optimization": {"stage": stage}, "pipeline": {"schedule": schedule}}
    eng, _, _, _ = deepspeed.initialize(model=net, config=config)
    return eng


def _data(eng):
    g = torch.Generator().manual_seed(100 + eng.grid.get_data_parallel_rank())
    return deepspeed.utils.RepeatingLoader(
        [(torch.randn(2, 8, generator=g), torch.randn(2, 1, generator=g)) for _ in range(6)])


def _worker(rank, world, outdir):
    out = {}
    for schedule in ("flush", "2bw"):
        for stage in (0, 1):
            eng = _engine(schedule, stage)
            it = _data(eng)
            losses = [float(eng.train_batch(it)) for _ in range(3)]
            opt = eng.optimizer.state_dict()
            out[(schedule, stage)] = {"losses": losses, "state": eng.fp32_state(),
                                      "sharded": opt.get("sharded")}
    save = os.path.join(outdir, "ckpt")
    eng = _engine("2bw", 1)
    it = _data(eng)
    for _ in range(2):
        eng.train_batch(it)
    eng.save_checkpoint(save)
    after = [float(eng.train_batch(it)) for _ in range(2)]
    resumed = {}
    for stage in (1, 0):
        again = _engine("2bw", stage)
        again.load_checkpoint(save)
        it2 = _data(again)
        for _ in range(4):      # the data of batch 2 on: 2 batches x 2 microbatches
            next(it2)
        resumed[stage] = [float(again.train_batch(it2)) for _ in range(2)]
    out["resume"] = {"after": after, "resumed": resumed}
    torch.save(out, os.path.join(outdir, f"{rank}.pt"))


def test_zero1_shards_the_optimizer_and_trains_like_the_unsharded_run():
    with tempfile.TemporaryDirectory() as d:
        spawn(_worker, 4, args=(d,), timeout_minutes=3)    # 2 stages x 2 replicas
        res = [torch.load(os.path.join(d, f"{r}.pt"), weights_only=False) for r in range(4)]
    for r in res:
        for schedule in ("flush", "2bw"):
            plain, zero = r[(schedule, 0)], r[(schedule, 1)]
            assert plain["sharded"] is None
            assert zero["sharded"]["count"] == 2    # each replica holds half the state
            assert torch.allclose(torch.tensor(zero["losses"]), torch.tensor(plain["losses"]),
                                  rtol=1e-5, atol=1e-7), schedule
            for k, v in plain["state"].items():
                assert torch.allclose(zero["state"][k], v, rtol=1e-5, atol=1e-6), (schedule, k)
        after, resumed = r["resume"]["after"], r["resume"]["resumed"]
        for stage in (1, 0):       # into ZeRO-1 again, and into an unsharded engine
            assert torch.allclose(torch.tensor(resumed[stage]), torch.tensor(after),
                                  rtol=1e-5, atol=1e-7), stage
