"""The NCCL device rule, caught on a CPU-only machine (issue 13).

On a GPU cluster NCCL rejects any tensor that is not on the rank's GPU, and the tensors careless
code makes for a collective (`torch.tensor([flag])`, no device) land on the default device, the
CPU. Here gloo communicates on the CPU, so the same mistake would pass unnoticed. These tests make
the careless tensor land elsewhere: the training loop runs with the default device set to "meta"
while the backend's device (comm.device) stays the CPU, exactly as on a cluster the default
device (CPU) differs from the backend's (cuda:k). The comm layer checks every tensor of every
collective against comm.device (parallel/comm.py), so a tensor made without naming the device
fails with its one-line CommDeviceError. Only what the test itself owns runs on the CPU default:
building the engine (parameters start on the CPU and move, as on a cluster) and the data loader.

Covered: training with data parallelism and a pipeline (p2p, dp/tied/mp reductions), per-iteration
logging (memory per stage), evaluation, periodic checkpoints, a preemption signal on one rank,
resume, and --exit-duration-in-mins. Then the bug of issue 13 (Preemption.agreed / the exit-duration
check all-reducing a CPU `torch.tensor([flag])`) is put back, and the same run fails.
"""
import json
import os
import signal
from contextlib import contextmanager

import pytest
import torch
from torch.multiprocessing import ProcessRaisedException

from megatron_2bw.checkpoint.api import LATEST
from megatron_2bw.config.build import build_config
from megatron_2bw.pretrain import build_parser
from megatron_2bw.training.spawn import spawn

BASE = ("--mock-data --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --global-batch-size 8 --pipeline-model-parallel-size 2 "
        "--lr 3e-3 --log-interval 1").split()
WORLD = 4                    # 2 stages x 2 data-parallel replicas
TRAIN_ITERS = 9
SIGNAL_AT_MICROBATCH = 5     # rank (stage 0, replica 1) gets SIGTERM while reading it


def make_cfg(argv):
    return build_config(build_parser("gpt").parse_args(BASE + argv), "gpt", WORLD).config


@contextmanager
def default_device(device):
    old = torch.get_default_device()
    torch.set_default_device(device)
    try:
        yield
    finally:
        torch.set_default_device(old)


def on_cpu(iterator):
    """A data loader: it builds its tensors on the CPU (the engine moves them to its device)."""
    while True:
        with default_device("cpu"):
            try:
                item = next(iterator)
            except StopIteration:
                return
        yield item


def signal_after(iterator, n):
    """Pass `iterator` through; SIGTERM this process after handing out n items."""
    for i, item in enumerate(iterator):
        if i == n:
            os.kill(os.getpid(), signal.SIGTERM)
        yield item


# -- the bug of issue 13, routed through the comm layer as a regression would be -----------------
def _old_preemption_agreed(self, engine):
    flag = torch.tensor([float(self.requested)])          # no device: the default one
    engine.grid.comm.all_reduce(flag, op="max")
    return bool(flag.item())


def _old_stop_requested(cfg, started, iteration, engine):
    import time
    if cfg.train.exit_interval and iteration % cfg.train.exit_interval == 0:
        return True
    if cfg.train.exit_duration_in_mins:
        flag = torch.tensor([float(time.time() - started > 60 * cfg.train.exit_duration_in_mins)])
        engine.grid.comm.all_reduce(flag, op="max")
        return bool(flag.item())
    return False


def _install_bug(bug):
    from megatron_2bw.training import loop as training
    from megatron_2bw.training import reliability
    if bug == "preemption":
        reliability.Preemption.agreed = _old_preemption_agreed
    elif bug == "exit-duration":
        training._stop_requested = _old_stop_requested


def _worker(rank, world_size, d, bug):
    from megatron_2bw.parallel.grid import ProcessGrid
    from megatron_2bw.training import build as building
    from megatron_2bw.training import loop as training
    _install_bug(bug)
    build = training.build_engine

    def build_on_cpu(*args, **kwargs):
        with default_device("cpu"):
            return build(*args, **kwargs)
    training.build_engine = build_on_cpu

    runs = {
        "preempted": make_cfg(["--train-iters", str(TRAIN_ITERS), "--save", f"{d}/ck",
                               "--save-interval", "2", "--eval-interval", "2",
                               "--eval-iters", "1"]),
        "resumed": make_cfg(["--train-iters", str(TRAIN_ITERS + 20), "--save", f"{d}/ck",
                             "--load", f"{d}/ck", "--exit-duration-in-mins", "1e-9",
                             "--eval-interval", "3", "--eval-iters", "1"]),
    }
    grid = ProcessGrid.from_config(runs["preempted"], rank, world_size).init_groups()
    signalled = grid.rank_of(0, 0, 1)
    out = {}
    for name, cfg in runs.items():
        dataset = building.mock_dataset(cfg)

        def make_data(start, cfg=cfg, dataset=dataset, name=name):
            it = building.batches(cfg, dataset, grid.data, grid.dp_rank, start)
            if name == "preempted" and rank == signalled:
                it = signal_after(it, SIGNAL_AT_MICROBATCH)
            return on_cpu(it)

        lines = []
        with default_device("meta"):   # careless tensors land here; the backend wants the CPU
            losses = training.train(cfg, grid, "cpu", make_data,
                                    lambda cfg=cfg, dataset=dataset: on_cpu(building.batches(
                                        cfg, dataset, grid.data, grid.dp_rank)),
                                    log=lines.append)
        out[name] = {"losses": losses, "lines": lines,
                     "latest": int(open(os.path.join(d, "ck", LATEST)).read())}
    with open(f"{d}/out.{rank}.json", "w") as f:
        json.dump(out, f)


def test_training_checkpoint_preemption_and_exit_duration_keep_the_device_rule(tmp_path):
    d = str(tmp_path)
    spawn(_worker, WORLD, args=(d, None), timeout_minutes=1)
    outs = [json.load(open(f"{d}/out.{r}.json")) for r in range(WORLD)]
    first, rest = outs[0]["preempted"], outs[0]["resumed"]
    for o in outs:                            # every rank decided the same, at the same boundary
        assert len(o["preempted"]["losses"]) == len(first["losses"])
        assert o["resumed"]["latest"] == rest["latest"]
    stopped = len(first["losses"])
    assert 1 < stopped < TRAIN_ITERS, "the signal on one rank stopped every rank early"
    assert first["latest"] == stopped, "checkpoint at the agreed boundary"
    reporter = outs[grid_rank_of_last_stage_replica0()]
    assert any(f"another rank: saved a checkpoint at iteration {stopped}" in line
               for line in reporter["preempted"]["lines"])
    assert any("validation loss" in line for line in reporter["preempted"]["lines"])
    # resumed at `stopped`; time is up from the first boundary: raised after iteration
    # stopped+1, carried by the next batch, acted on after the one after it (flags.py)
    assert len(rest["losses"]) == 3 and rest["latest"] == stopped + 3


def grid_rank_of_last_stage_replica0():
    from megatron_2bw.parallel.grid import ProcessGrid
    return ProcessGrid(1, 2, 2).rank_of(0, 1, 0)


@pytest.mark.parametrize("bug", ["preemption", "exit-duration"])
def test_the_issue_13_bug_fails_the_device_rule(tmp_path, bug):
    with pytest.raises(ProcessRaisedException,
                       match=r"CommDeviceError: all_reduce: tensor on meta, but the gloo backend "
                             r"of rank \d communicates on cpu"):
        spawn(_worker, WORLD, args=(str(tmp_path), bug), timeout_minutes=1)
