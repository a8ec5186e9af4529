"""Resume on a new allocation (issue 18): before any process group, pretrain says what the
checkpoint was saved with and what changed (--auto-plan picks the layout for the new world
size); a torch-format checkpoint of another layout, or another global batch, is one line naming
the fix. The slow test resumes a 2-rank torch_dist run on 4 ranks with --auto-plan through
torchrun."""
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_2bw.checkpoint import files as checkpoint_files
from megatron_2bw.checkpoint.api import load_checkpoint, save_checkpoint
from megatron_2bw.checkpoint.convert.to_dist import torch_to_dist
from megatron_2bw.checkpoint.files import latest_iteration
from megatron_2bw.checkpoint.saver import Checkpointer
from megatron_2bw.training.build import mock_batches
from test_ckpt_async import _one_rank
from test_fault_table import _front_door as fault_table_front_door

ROOT = Path(__file__).resolve().parents[2]
TINY = ("--mock-data --num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
        "--micro-batch-size 2 --global-batch-size 4").split()


def _front_door(argv, world, monkeypatch, capsys):
    """pretrain.parse on rank 0 of `world` (no process group): (exit code, stdout lines,
    stderr lines)."""
    code, out, err = fault_table_front_door(argv, monkeypatch, capsys, world, TINY)
    # the one-stage 2bw warning (tests/unit/test_one_stage_schedule.py) is not read here
    return code, [line for line in out.splitlines() if "for nothing" not in line], err


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


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_a_checkpoint_records_its_compensation_and_a_change_is_logged(
        one_rank_checkpoints, monkeypatch, capsys, fmt):
    ck = one_rank_checkpoints / fmt
    code, out, err = _front_door(["--load", ck, "--pipeline-schedule", "2bw", "--ckpt-format",
                                  fmt, "--2bw-compensation", "predict"], 1, monkeypatch, capsys)
    assert code == 0, err
    world = " on 1 ranks" if fmt == "torch_dist" else ""
    assert out == [f"resuming iteration 2 of --load {ck} ({fmt}) saved with t=1 d=1 w="
                   f"{1 if fmt == 'torch_dist' else '?'} 2bw{world}, now t=1 d=1 w=1 "
                   "2bw+predict on 1 ranks: compensation changed; batch 2 runs on the version "
                   "the checkpoint saved for it (W(1)), later batches on the predict prediction "
                   "of W(t)"]
    code, out, err = _front_door(["--load", ck, "--pipeline-schedule", "2bw", "--ckpt-format",
                                  fmt, "--2bw-compensation", "predict-nesterov"], 1, monkeypatch,
                                 capsys)
    assert code == 0, err
    assert out[0].endswith("later batches on the predict-nesterov prediction of W(t); the "
                           "checkpoint keeps no gradient, so batch 3 runs on the predict "
                           "prediction (the optimizer's last_grad starts as its momentum)"), out


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


def test_the_loss_scale_skipped_steps_step_count_and_rng_carry_over(tmp_path):
    """torch_dist, one process: what is not a tensor of the model carries over too (the lr
    schedule follows the iteration and the step count)."""
    argv = ["--fp16", "--initial-loss-scale", str(2.0 ** 16), "--loss-scale-window", "2",
            "--lr-decay-style", "cosine",
            "--lr-warmup-iters", "2", "--save", str(tmp_path)]
    engine, cfg, grid = _one_rank(argv)
    data = mock_batches(cfg, 1, 0)
    for _ in range(3):
        engine.train_batch(data)
    scaler = engine.stepper.scaler.state_dict()
    assert scaler["scale"] == 2.0 ** 17 and scaler["clean"] == 1, "grown: not a fresh scaler's"
    engine.stepper.skipped = 1  # as if one step had overflowed
    torch.manual_seed(1234)
    save_checkpoint(str(tmp_path), engine, cfg, grid)
    expected_rng = torch.get_rng_state()
    torch.manual_seed(99)
    fresh, _, _ = _one_rank(argv)
    assert load_checkpoint(str(tmp_path), fresh, cfg, grid) == 3
    assert fresh.stepper.scaler.state_dict() == scaler
    assert fresh.stepper.skipped == 1 and fresh.skipped_iterations == engine.skipped_iterations
    assert fresh.state_dict()["optimizer"]["steps"] == engine.state_dict()["optimizer"]["steps"]
    assert torch.equal(torch.get_rng_state(), expected_rng)
    # the saved engine goes on with its own stream (its windows already read part of batch 3)
    assert torch.equal(fresh.train_batch(mock_batches(cfg, 1, 0, start_batch=3)),
                       engine.train_batch(data))
    assert fresh.stepper.last_lr == engine.stepper.last_lr  # the schedule's position
    assert torch.equal(fresh.state_dict()["newest"], engine.state_dict()["newest"])


def test_checksums_are_computed_while_writing(tmp_path, monkeypatch):
    """No file of a save is read back to hash it (checkpoint_files.sha256_of is for readers)."""
    engine, cfg, grid = _one_rank(["--save", str(tmp_path), "--async-save"])
    engine.train_batch(mock_batches(cfg, 1, 0))

    def reread(path):
        raise AssertionError(f"a save re-read {path}")
    monkeypatch.setattr(checkpoint_files, "sha256_of", reread)  # every reader's hash
    saver = Checkpointer(cfg, grid, engine)
    saver.save(wait=True)
    monkeypatch.undo()
    directory = tmp_path / "iter_0000001"
    sums = dict(reversed(line.split("  ")) for line in
                (directory / "checksums.sha256").read_text().splitlines())
    assert set(sums) == set(os.listdir(directory)) - {"checksums.sha256"}
    for name, digest in sums.items():
        assert hashlib.sha256((directory / name).read_bytes()).hexdigest() == digest, name


def test_a_truncated_torch_stage_file_is_one_line_before_anything_unpickles_it(
        one_rank_checkpoints, tmp_path, monkeypatch, capsys):
    """Resuming reads the first stage file before any process group, on every rank: the zip
    records torch.load unpickles are checked first (zip's CRC-32; no rank reads the tensors,
    nor hashes the whole file: the loader does, once per job), so a truncated file or a damaged
    data.pkl is one line naming it and the fix (it was torch's zip traceback)."""
    import io
    import shutil
    import struct
    import zipfile
    ck = tmp_path / "torch"
    shutil.copytree(one_rank_checkpoints / "torch", ck)
    stage = ck / "iter_0000002" / "mp_rank_00" / "model_optim_rng.pt"
    data = stage.read_bytes()
    flags = ["--load", ck, "--pipeline-schedule", "2bw", "--ckpt-format", "torch"]
    stage.write_bytes(data[:len(data) // 2])
    code, out, err = _front_door(flags, 1, monkeypatch, capsys)
    assert (code, out) == (2, [])
    assert err == [f"error: --load {ck}: checkpoint file {stage} is truncated or corrupted "
                   "(BadZipFile: File is not a zip file): load an earlier iteration"]
    with zipfile.ZipFile(io.BytesIO(data)) as z:  # a byte of data.pkl's payload
        info = next(i for i in z.infolist() if i.filename.endswith("/data.pkl"))
    names, extra = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])
    pickle = info.header_offset + 30 + names + extra + 5
    stage.write_bytes(data[:pickle] + bytes([data[pickle] ^ 0xFF]) + data[pickle + 1:])
    code, out, err = _front_door(flags, 1, monkeypatch, capsys)
    assert (code, out) == (2, []) and len(err) == 1
    assert err[0].startswith(f"error: --load {ck}: checkpoint file {stage} is truncated or "
                             "corrupted (BadZipFile: Bad CRC-32 for file"), err


@pytest.mark.parametrize("fmt,hashed", [("torch", []), ("torch_dist", ["common.pt"])])
def test_the_resume_check_on_every_rank_hashes_no_stage_file(one_rank_checkpoints, monkeypatch,
                                                             capsys, fmt, hashed):
    """Every rank runs it before any process group: it hashes the small common.pt (torch_dist)
    and no stage file (torch: zip's CRC-32 of data.pkl), which the loader hashes once per job."""
    seen, real = [], checkpoint_files.sha256_of
    monkeypatch.setattr(checkpoint_files, "_DIGESTS", {})
    monkeypatch.setattr(checkpoint_files, "sha256_of",
                        lambda path: seen.append(os.path.basename(path)) or real(path))
    code, _, err = _front_door(["--load", one_rank_checkpoints / fmt, "--pipeline-schedule",
                                "2bw", "--ckpt-format", fmt], 1, monkeypatch, capsys)
    assert code == 0, err
    assert seen == hashed
