"""Checkpoint and resume: losses after a resume are bitwise identical to an uninterrupted run
(2bw plain and compensated, flush, gpipe; d=2, dropout on), including resuming into another --save-interval."""
import os
import tempfile

import pytest
import torch

from matrix import matrix
from megatron_2bw.checkpoint.api import LATEST, CheckpointError, rank_dir
from megatron_2bw.checkpoint.dist.load import is_dist_checkpoint, read_common, read_full
from megatron_2bw.checkpoint.files import iteration_dir
from megatron_2bw.config.build import build_config
from megatron_2bw.parallel.grid import ProcessGrid
from megatron_2bw.pipeline.faults import NO_FAULTS
from megatron_2bw.pretrain import build_parser
from megatron_2bw.training.build import batches, mock_dataset
from megatron_2bw.training.loop import train
from megatron_2bw.training.spawn import spawn

BASE = ("--mock-data --num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --global-batch-size 8 --pipeline-model-parallel-size 2 "
        "--hidden-dropout 0.1 --attention-dropout 0.1 --lr 3e-3 --log-interval 1").split()


def make_cfg(argv, family="gpt"):
    return build_config(build_parser(family).parse_args(BASE + argv), family, 2).config


def _worker(rank, world_size, cfg, out, hooks=NO_FAULTS, log=None):
    grid = ProcessGrid.from_config(cfg, rank, world_size).init_groups()
    dataset = mock_dataset(cfg)
    lines = []
    losses = train(cfg, grid, "cpu",
                   make_data=lambda start: batches(cfg, dataset, grid.data, grid.dp_rank, start),
                   log=lines.append, hooks=hooks)
    torch.save(losses, f"{out}.{rank}")
    if log:
        open(f"{log}.{rank}", "w").write("".join(line + "\n" for line in lines))


def run(cfg, out, hooks=NO_FAULTS, log=None):
    """Train on 2 spawned ranks (`hooks`: faults to inject; `log`: each rank writes its log
    lines to {log}.{rank}); returns the losses."""
    spawn(_worker, 2, args=(cfg, out, hooks, log), timeout_minutes=1)
    losses = [torch.load(f"{out}.{r}") for r in range(2)]
    assert losses[0] == losses[1], "every rank reports the same losses"
    return losses[0]


def newest_weights(save_dir):
    """[{"iteration", "newest", "previous"?}] of the newest checkpoint, in either format."""
    it = int(open(os.path.join(save_dir, LATEST)).read())
    directory = iteration_dir(save_dir, it)
    if not is_dist_checkpoint(directory):
        return [torch.load(os.path.join(rank_dir(save_dir, it, 0, s, 2), "model_optim_rng.pt"),
                           weights_only=True)["engine"] for s in range(2)]
    out = {"iteration": read_common(directory)["iteration"]}
    for key, prefix in (("newest", "model."), ("previous", "model_previous.")):
        tensors = read_full(directory, prefix)
        if tensors:
            out[key] = torch.cat([tensors[n].flatten() for n in sorted(tensors)])
    return [out]


@pytest.mark.parametrize("schedule,fmt", matrix(
    [("2bw", "torch_dist"), ("2bw+predict", "torch_dist"), ("2bw+predict-spike", "torch_dist"),
     ("2bw+predict-nesterov", "torch_dist"), ("2bw+predict-nesterov", "torch"),
     ("flush", "torch_dist"), ("gpipe", "torch_dist"), ("gpipe", "torch"), ("2bw", "torch")],
    default=[("2bw", "torch_dist"), ("2bw+predict-nesterov", "torch"), ("flush", "torch_dist"),
             ("gpipe", "torch")]))
def test_resume_is_bitwise_identical(schedule, fmt):
    """2bw+M: with --2bw-compensation M (the slot of the next batch holds a prediction)."""
    name, _, method = schedule.partition("+")
    sched = ["--pipeline-schedule", name, "--2bw-compensation", method or "none",
             "--ckpt-format", fmt]
    with tempfile.TemporaryDirectory() as d:
        full = run(make_cfg(sched + ["--train-iters", "6", "--save", f"{d}/a"]), f"{d}/full")
        first = run(make_cfg(sched + ["--train-iters", "6", "--save", f"{d}/b",
                                      "--save-interval", "2", "--exit-interval", "3"]),
                    f"{d}/first")
        assert len(first) == 3 and first == full[:3]
        rest = run(make_cfg(sched + ["--train-iters", "6", "--save", f"{d}/b", "--load",
                                     f"{d}/b", "--save-interval", "4"]), f"{d}/rest")
        assert rest == full[3:], (rest, full[3:])
        for a, b in zip(newest_weights(f"{d}/a"), newest_weights(f"{d}/b")):
            assert a["iteration"] == b["iteration"] == 6
            assert torch.equal(a["newest"], b["newest"])
            assert ("previous" in a) == (name == "2bw")
            if "previous" in a:
                assert torch.equal(a["previous"], b["previous"])


def test_checkpoint_of_another_shape_is_a_clear_error():
    with tempfile.TemporaryDirectory() as d:
        run(make_cfg(["--train-iters", "1", "--save", d]), f"{d}/x")
        cfg = make_cfg(["--train-iters", "2", "--load", d, "--hidden-size", "64"])
        with pytest.raises(Exception, match="hidden_size 32 != 64"):
            spawn(_worker, 2, args=(cfg, f"{d}/y"), timeout_minutes=1)
        open(os.path.join(d, LATEST), "w").write("garbage")
        from megatron_2bw.checkpoint.api import latest_iteration
        with pytest.raises(CheckpointError, match=LATEST):
            latest_iteration(d)
