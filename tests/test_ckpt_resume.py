"""Resume on a new allocation (issue 18): before any process group, pretrain says what the
checkpoint was saved with and what changed (--auto-plan picks the layout for the new world
size); a torch-format checkpoint of another layout, or another global batch, is one line naming
the fix. The slow test resumes a 2-rank torch_dist run on 4 ranks with --auto-plan through
torchrun."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_2bw.checkpoint_files import latest_iteration
from megatron_2bw.checkpointing import save_checkpoint
from megatron_2bw.ckpt.convert import torch_to_dist
from megatron_2bw.training import mock_batches
from test_ckpt_async import _one_rank
from test_fault_table import _front_door as fault_table_front_door

ROOT = Path(__file__).resolve().parent.parent
TINY = ("--mock-data --num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
        "--micro-batch-size 2 --global-batch-size 4").split()


def _front_door(argv, world, monkeypatch, capsys):
    """pretrain.parse on rank 0 of `world` (no process group): (exit code, stdout lines,
    stderr lines)."""
    code, out, err = fault_table_front_door(argv, monkeypatch, capsys, world, TINY)
    return code, out.splitlines(), err


@pytest.fixture(scope="module")
def one_rank_checkpoints(tmp_path_factory):
    """Iteration 2 of a one-rank 2bw run, in both formats."""
    d = tmp_path_factory.mktemp("resume")
    for fmt in ("torch_dist", "torch"):
        engine, cfg, grid = _one_rank(["--pipeline-schedule", "2bw", "--ckpt-format", fmt])
        data = mock_batches(cfg, 1, 0)
        for _ in range(2):
            engine.train_batch(data)
        save_checkpoint(str(d / fmt), engine, cfg, grid)
    return d


def test_a_new_layout_is_logged_with_what_changed(one_rank_checkpoints, monkeypatch, capsys):
    ck = one_rank_checkpoints / "torch_dist"
    code, out, err = _front_door(["--load", ck, "--pipeline-model-parallel-size", "2",
                                  "--pipeline-schedule", "flush"], 2, monkeypatch, capsys)
    assert code == 0, err
    assert out == [f"resuming iteration 2 of --load {ck} (torch_dist) saved with t=1 d=1 w=1 2bw "
                   "on 1 ranks, now t=1 d=2 w=1 flush on 2 ranks: pipeline, world, schedule "
                   "changed; every rank reads its own shards of the global tensors; flush "
                   "continues from the newest weights W(2)"]
    code, out, _ = _front_door(["--load", ck, "--pipeline-schedule", "2bw"], 1, monkeypatch,
                               capsys)
    assert code == 0 and out == [], "the same layout says nothing"


def test_auto_plan_chooses_the_layout_for_the_new_world_size(one_rank_checkpoints, monkeypatch,
                                                             capsys):
    ck = one_rank_checkpoints / "torch_dist"
    code, out, err = _front_door(["--load", ck, "--auto-plan", "--no-memory-check"], 4,
                                 monkeypatch, capsys)
    assert code == 0, err
    plan = [line for line in out if line.startswith("auto-plan:")]
    notes = [line for line in out if line.startswith("resuming")]
    assert len(plan) == 1 and len(notes) == 1, out
    assert notes[0].startswith(f"resuming iteration 2 of --load {ck} (torch_dist) saved with "
                               "t=1 d=1 w=1 2bw on 1 ranks, now ")
    assert "on 4 ranks (chosen by --auto-plan): " in notes[0] and "world" in notes[0]


def test_a_torch_format_checkpoint_of_another_layout_is_one_line(one_rank_checkpoints,
                                                                 monkeypatch, capsys, tmp_path):
    ck = one_rank_checkpoints / "torch"
    code, out, err = _front_door(["--load", ck, "--pipeline-model-parallel-size", "2"], 2,
                                 monkeypatch, capsys)
    assert code == 2 and out == []
    assert err == [f"error: --load {ck} holds a torch-format checkpoint (iteration 2) saved with "
                   "t=1 d=1; it loads only into that layout, this run is t=1 d=2: convert it "
                   f"with tools/checkpoint_convert.py to-dist --load {ck} --save NEW and --load "
                   "NEW, or use matching flags"]
    torch_to_dist(str(ck), str(tmp_path / "new"))
    code, out, err = _front_door(["--load", tmp_path / "new", "--pipeline-model-parallel-size",
                                  "2"], 2, monkeypatch, capsys)
    assert code == 0 and len(out) == 1 and "(torch_dist)" in out[0], err


def test_another_global_batch_is_one_line(one_rank_checkpoints, monkeypatch, capsys):
    ck = one_rank_checkpoints / "torch_dist"
    code, _, err = _front_door(["--load", ck, "--global-batch-size", "8"], 1, monkeypatch,
                               capsys)
    assert code == 2
    assert err == [f"error: --load {ck} consumed 8 samples in 2 iterations (global batch 4); "
                   "this run's global batch 8 would resume from other samples: use "
                   "--global-batch-size 4"]


def _torchrun(n, *argv):
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="offline", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           str(n), str(ROOT / "pretrain_gpt.py"), *TINY,
                           "--distributed-backend", "gloo", *map(str, argv)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)


@pytest.mark.slow
def test_a_run_resumes_on_twice_the_ranks_with_auto_plan(tmp_path):
    ck = tmp_path / "ck"
    first = _torchrun(2, "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "2bw",
                      "--train-iters", "3", "--save", ck)
    assert first.returncode == 0, first.stderr[-3000:]
    rest = _torchrun(4, "--auto-plan", "--no-memory-check", "--train-iters", "5", "--load", ck,
                     "--save", ck, "--async-save")
    assert rest.returncode == 0, rest.stderr[-3000:]
    note = [line for line in rest.stdout.splitlines() if line.startswith("resuming")]
    assert len(note) == 1 and "on 4 ranks (chosen by --auto-plan)" in note[0], rest.stdout
    assert latest_iteration(str(ck)) == 5
