"""DeepSpeed's monitors read back: csv_monitor's files as DeepSpeed writes them, TensorBoard
events and the offline wandb history, each holding Train/Samples/train_loss and lr at step =
global_samples (and eval_loss after eval_batch), written by rank 0 only."""
import csv
import os
import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn

import megatron_2bw as deepspeed
from megatron_2bw.training.spawn import spawn


def _worker(rank, world, root):
    torch.manual_seed(0)
    net = deepspeed.pipe.PipelineModule(layers=[nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)],
                                        num_stages=2, loss_fn=nn.MSELoss())
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.05}}, "steps_per_print": 100,
              "pipeline": {"schedule": "flush"},
              "tensorboard": {"enabled": True, "output_path": f"{root}/tb", "job_name": "job"},
              "csv_monitor": {"enabled": True, "output_path": f"{root}/csv", "job_name": "job"},
              "wandb": {"enabled": True, "project": "ds-monitors"}}
    eng, _, _, _ = deepspeed.initialize(model=net, config=config)
    g = torch.Generator().manual_seed(1)
    data = deepspeed.utils.RepeatingLoader([(torch.randn(2, 4, generator=g),
                                             torch.randn(2, 1, generator=g)) for _ in range(4)])
    losses = [float(eng.train_batch(data)) for _ in range(3)]
    evaluated = float(eng.eval_batch(data))
    eng.monitor.close()
    torch.save({"losses": losses, "eval": evaluated, "lr": eng.get_lr()[0],
                "monitors": len(eng.monitor.monitors)}, f"{root}/{rank}.pt")


def test_monitors_read_back(monkeypatch):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from megatron_2bw.testing.wandb_offline import read_history
    monkeypatch.setenv("WANDB_MODE", "offline")
    with tempfile.TemporaryDirectory() as root:
        monkeypatch.chdir(root)     # DeepSpeed's wandb run lands in the working directory
        spawn(_worker, 2, args=(root,), timeout_minutes=2)
        r0, r1 = (torch.load(f"{root}/{r}.pt") for r in (0, 1))
        assert (r0["monitors"], r1["monitors"]) == (3, 0)     # rank 0 writes, once
        steps = [4, 8, 12]          # global_samples: 2 x 2 per batch
        with open(Path(root, "csv", "job", "Train_Samples_train_loss.csv")) as f:
            rows = list(csv.reader(f))
        assert rows[0] == ["step", "train_loss"]
        assert [int(s) for s, _ in rows[1:]] == steps
        assert [float(v) for _, v in rows[1:]] == pytest.approx(r0["losses"], rel=1e-6)
        assert sorted(os.listdir(Path(root, "csv", "job"))) == [
            "Train_Samples_eval_loss.csv", "Train_Samples_lr.csv", "Train_Samples_train_loss.csv"]
        with open(Path(root, "csv", "job", "Train_Samples_eval_loss.csv")) as f:
            assert list(csv.reader(f))[1] == ["12", repr(r0["eval"])]
        acc = EventAccumulator(str(Path(root, "tb", "job")), size_guidance={"scalars": 0})
        acc.Reload()
        board = [(e.step, e.value) for e in acc.Scalars("Train/Samples/train_loss")]
        assert [s for s, _ in board] == steps
        assert [v for _, v in board] == pytest.approx(r0["losses"], rel=1e-6)
        assert [e.step for e in acc.Scalars("Train/Samples/lr")] == steps
        (run,) = Path(root, "wandb").rglob("offline-run-*")
        history = [row for row in read_history(str(run)) if "Train/Samples/train_loss" in row]
        assert [row["_step"] for row in history] == steps
        assert [row["Train/Samples/train_loss"] for row in history] == \
            pytest.approx(r0["losses"], rel=1e-6)
