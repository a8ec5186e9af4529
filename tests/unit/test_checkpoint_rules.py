"""The rules that keep checkpoints whole, one process, no process group: a save never goes over a
newer iteration and `latest` only moves forward; non-finite weights are never written; a full
disk is one line naming ENOSPC; the tokenizer's record is published with a save or not at all;
start-up removes only our temporary files, and only once the checks passed; and the fp16 skip limit,
the second Ctrl-C, and production code that reads no fault-injection setting."""
import os
import re
import signal
from pathlib import Path

import pytest
import torch

from megatron_2bw.checkpoint.api import preflight, remove_leftovers, save_checkpoint
from megatron_2bw.checkpoint.files import LATEST, CheckpointError, latest_iteration, write_latest
from megatron_2bw.checkpoint.files import write_checkpoint_file
from megatron_2bw.config import ConfigError, PrecisionConfig, TrainConfig
from megatron_2bw.config.build import build_config
from megatron_2bw.config.flags import config_from_args
from megatron_2bw.pipeline.faults import NumericsError
from megatron_2bw.pretrain import build_parser
from megatron_2bw.parallel.grid import ProcessGrid
from megatron_2bw.training.build import build_engine
from megatron_2bw.training.reliability import Preemption

ROOT = Path(__file__).resolve().parents[2]


def _engine(*flags):
    argv = ("--mock-data --num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
            "--micro-batch-size 2 --global-batch-size 4").split()
    cfg = build_config(build_parser("gpt").parse_args(argv + list(flags)), "gpt", 1).config
    grid = ProcessGrid.from_config(cfg, 0, 1).init_groups()
    return build_engine(cfg, grid, "cpu"), cfg, grid


def _files(d):
    return sorted(str(p.relative_to(d)) for p in Path(d).rglob("*") if p.is_file())


def test_a_save_never_goes_over_a_newer_iteration_and_latest_only_moves_forward(tmp_path):
    engine, cfg, grid = _engine()
    engine.iteration = 3
    save_checkpoint(str(tmp_path), engine, cfg, grid)
    before = {f: (tmp_path / f).read_bytes() for f in _files(tmp_path)}
    for older in (3, 2):
        engine.iteration = older
        with pytest.raises(CheckpointError, match=f"refusing to save iteration {older} into "
                                                  f"{tmp_path}: it already holds the newer "
                                                  "iteration 3"):
            save_checkpoint(str(tmp_path), engine, cfg, grid)
    assert {f: (tmp_path / f).read_bytes() for f in _files(tmp_path)} == before
    with pytest.raises(CheckpointError, match="refusing to save iteration 1"):
        write_latest(str(tmp_path), 1)
    assert latest_iteration(str(tmp_path)) == 3
    write_latest(str(tmp_path), 4)
    assert latest_iteration(str(tmp_path)) == 4


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_the_tokenizer_is_recorded_with_a_save_and_a_failed_save_puts_the_old_record_back(
        tmp_path, monkeypatch, fmt):
    """`beside` (pretrain: convert/tokenizers.tokenizer_files) is published with the save,
    before `latest` moves: a save whose `latest` cannot be written leaves the directory as it
    was, the record of the run before included; a record that holds these bytes is left
    alone."""
    from megatron_2bw.checkpoint import files
    engine, cfg, grid = _engine("--ckpt-format", fmt)
    (tmp_path / "tokenizer_args.json").write_bytes(b'{"tokenizer_type": "GPT2BPETokenizer"}\n')
    before = {f: (tmp_path / f).read_bytes() for f in _files(tmp_path)}
    beside = {"tokenizer.model": b"a sentencepiece model",
              "tokenizer_args.json": b'{"tokenizer_type": "GPTSentencePieceTokenizer"}\n'}

    def full_disk(directory, iteration):
        raise CheckpointError(f"cannot write {directory}/{LATEST}: No space left on device")
    monkeypatch.setattr(files, "write_latest", full_disk)
    engine.iteration = 2
    with pytest.raises(CheckpointError, match="No space left on device"):
        save_checkpoint(str(tmp_path), engine, cfg, grid, beside=beside)
    assert {f: (tmp_path / f).read_bytes() for f in _files(tmp_path)} == before
    monkeypatch.undo()
    save_checkpoint(str(tmp_path), engine, cfg, grid, beside=beside)
    assert latest_iteration(str(tmp_path)) == 2
    assert {f: (tmp_path / f).read_bytes() for f in beside} == beside
    inodes = {f: os.stat(tmp_path / f).st_ino for f in beside}
    engine.iteration = 3
    save_checkpoint(str(tmp_path), engine, cfg, grid, beside=beside)
    assert latest_iteration(str(tmp_path)) == 3
    assert {f: os.stat(tmp_path / f).st_ino for f in beside} == inodes, "left alone"


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_nonfinite_weights_are_never_written(tmp_path, poison):
    engine, cfg, grid = _engine()
    engine.iteration = 2
    save_checkpoint(str(tmp_path), engine, cfg, grid)
    before = _files(tmp_path)
    engine.iteration = 4
    with torch.no_grad():
        engine.weights.slots[engine._newest_slot()][7] = poison
    with pytest.raises(NumericsError, match=r"the newest weights of rank 0 .* are not finite in "
                                            r"torch.float32 .* at iteration 4: no checkpoint "
                                            rf"written \(the last good one is iteration 2 in "):
        save_checkpoint(str(tmp_path), engine, cfg, grid)
    assert _files(tmp_path) == before and latest_iteration(str(tmp_path)) == 2


def test_a_full_disk_is_one_line_naming_enospc_and_leaves_nothing(tmp_path, monkeypatch):
    """Writes to /dev/full fail with ENOSPC, as on a full file system; torch.save alone would
    report 'unexpected pos'."""
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    import builtins

    from megatron_2bw import fs
    monkeypatch.setattr(fs, "open", lambda path, mode: builtins.open("/dev/full", "wb"),
                        raising=False)
    path = tmp_path / "model_optim_rng.pt"
    with pytest.raises(CheckpointError) as e:
        write_checkpoint_file(str(path), lambda f: torch.save({"w": torch.zeros(100_000)}, f))
    assert re.fullmatch(rf"cannot write checkpoint file {path}: No space left on device "
                        r"\(ENOSPC\) after \d+ bytes: free space on that file system or point "
                        "--save elsewhere", str(e.value)), str(e.value)
    assert _files(tmp_path) == []


def test_start_up_removes_only_our_temporary_files_and_only_after_the_checks(tmp_path):
    ours = [tmp_path / ".tmp-abc", tmp_path / "iter_0000002" / "mp_rank_00_001" / ".tmp-x1"]
    theirs = [tmp_path / "wandb" / ".tmp-run", tmp_path / "iter_0000002" / "mp_rank_00_001" /
              "model_optim_rng.pt", tmp_path / "notes.tmp-1"]
    for p in ours + theirs:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x")
    lines = []
    for rank in (0, 1):  # the checks before any process group write nothing
        preflight(TrainConfig(save=str(tmp_path)), rank=rank, log=lines.append)
    assert lines == [] and all(p.exists() for p in ours + theirs)
    remove_leftovers(str(tmp_path), log=lines.append)  # training/loop.py: rank 0, all started
    assert lines == [f"removed {p}: the leftover of a checkpoint write that was killed"
                     for p in sorted(map(str, ours))]
    assert not any(p.exists() for p in ours) and all(p.exists() for p in theirs)


def test_load_must_hold_a_checkpoint_unless_it_is_save(tmp_path):
    missing = str(tmp_path / "missing")
    with pytest.raises(CheckpointError, match=f"--load {missing} does not exist: fix the path"):
        preflight(TrainConfig(load=missing, save=str(tmp_path / "other")))
    assert not os.path.exists(tmp_path / "other") or os.listdir(tmp_path / "other") == []
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="is a file, not a checkpoint directory"):
        preflight(TrainConfig(load=str(tmp_path / "file")))
    lines = []
    assert preflight(TrainConfig(load=missing, save=missing + "/."), log=lines.append) == 0
    assert len(lines) == 1 and "equals --save: starting from scratch" in lines[0]
    (tmp_path / "missing" / LATEST).write_text("7\n")
    (tmp_path / "missing" / "iter_0000007").mkdir()
    assert preflight(TrainConfig(load=missing, save=missing, train_iters=7)) == 7
    assert preflight(TrainConfig(load=missing, train_iters=3, finetune=True)) == 0


def test_the_fp16_skip_limit_defaults_to_the_loss_scale_fall_plus_ten():
    assert PrecisionConfig(dtype="fp16").skip_limit() == 1 + 16 + 10
    assert PrecisionConfig(dtype="fp16", initial_loss_scale=2.0 ** 32).skip_limit() == 43
    assert PrecisionConfig(dtype="fp16", loss_scale=128.0).skip_limit() == 10
    assert PrecisionConfig(dtype="fp16", max_skipped_steps=0).skip_limit() == 0
    args = build_parser("gpt").parse_args(["--fp16", "--max-skipped-steps", "-1"])
    with pytest.raises(ConfigError, match="--max-skipped-steps must be >= 0 "):
        config_from_args(args).validate(1)


def test_a_second_ctrl_c_a_second_later_aborts():
    p = Preemption()
    try:  # raise_signal: to this thread, its Python handler has run when it returns (no sleep)
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)  # torchrun forwarding the same Ctrl-C: not an abort
        assert p.requested and p.signal_name == "SIGINT"
        p._interrupted_at -= p.ABORT_AFTER_S
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    finally:
        p.restore()


def test_production_code_reads_no_fault_injection_setting():
    files = [*ROOT.glob("megatron_2bw/**/*.py"), *ROOT.glob("pretrain_*.py"),
             *ROOT.glob("tools/**/*.py"), *ROOT.glob("bench/**/*.py"),
             *ROOT.glob("examples/**/*.py")]
    assert len(files) > 50
    env_read = re.compile(r"(environ|getenv)\W[^\n]*(?<![a-z])fault", re.IGNORECASE)
    for f in files:
        text = f.read_text()
        assert "MEGATRON_2BW_FAULT" not in text, f
        assert not env_read.search(text), f


def test_latest_naming_an_iteration_that_does_not_exist_is_one_line(tmp_path):
    """Not a message about --train-iters (issue 29): the file, the iteration and what exists."""
    from megatron_2bw.checkpoint.api import load_checkpoint
    ck = tmp_path / "ck"
    (ck / "iter_0000002").mkdir(parents=True)
    (ck / "iter_0000004").mkdir()
    (ck / LATEST).write_text("9\n")
    want = (f"{ck / LATEST} names iteration 9 but iter_0000009 does not exist in {ck} (it holds "
            f"iter_0000002, iter_0000004): write an existing iteration into {LATEST}, or load "
            "another directory")
    with pytest.raises(CheckpointError) as e:
        preflight(TrainConfig(load=str(ck), train_iters=3))
    assert str(e.value) == f"--load: {want}"
    with pytest.raises(CheckpointError) as e:  # the loader's own check (after the agreement)
        load_checkpoint(str(ck), None, None, ProcessGrid(1, 1, 1))
    assert str(e.value) == want
