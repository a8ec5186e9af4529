"""The fault table: each fault of a real run (torchrun, 2 stages, the tiny model) and how the run
must end: exit code, the one line it prints, and the checkpoint directory it leaves.

| fault                                   | ends with                       | checkpoints          |
|-----------------------------------------|---------------------------------|----------------------|
| kill -9 / SIGUSR1 of torchrun           | workers gone in 10 s, one line  | none written after   |
| --load typo (missing directory)         | exit 2, one line                | byte-identical       |
| fresh run into a newer --save           | exit 2, one line                | byte-identical       |
| --train-iters below the checkpoint      | exit 2, one line                | byte-identical       |
| --save under a regular file             | exit 2, one line, no training   | -                    |
| fp16 divergence (--lr 1e6)              | exit 1, one line, no traceback  | none non-finite      |
| kill -9 during a save                   | next start removes `.tmp-*`     | previous intact      |
| corrupted checkpoint                    | exit 1, one line, no traceback  | untouched            |
| disk full during a save                 | exit 1, one line naming ENOSPC  | previous intact      |
| resume with another precision           | exit 0, one line, fresh scaler  | -                    |
| SIGINT (test_faults.py)                 | exit 0 after a checkpoint       | final one written    |
"""
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procs import alive, children
import torch

from megatron_2bw.checkpoint.dist.load import read_full
from megatron_2bw.checkpoint.files import LATEST, TMP_PREFIX, temporary_files
from log_lines import interval_fields

ROOT = Path(__file__).resolve().parents[2]
ENTRY = str(ROOT / "tests" / "fault_entry.py")
TINY = ["--mock-data", "--pipeline-model-parallel-size", "2", "--num-layers", "2",
        "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--log-interval", "1",
        "--distributed-timeout-minutes", "0.5"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            "2", ENTRY]


def _env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(WANDB_MODE="offline", PYTHONPATH=str(ROOT))
    return env


def torchrun(*flags, inject=None, timeout=300):  # bounds a hang: two ranks start and train
    injected = ["--inject", inject] if inject else []
    return subprocess.run(TORCHRUN + injected + TINY + [str(f) for f in flags], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=timeout)


def errors(proc) -> list[str]:
    """The lines our code printed on stderr (torchrun adds its own report on failures). When
    every rank fails alike, each prints the line unless torchrun stopped it first."""
    return [line for line in proc.stderr.splitlines() if line.startswith("error: ")]


def our_traceback(proc) -> bool:
    """A traceback through this package (torchrun prints its own report of a failed worker)."""
    return str(ROOT / "megatron_2bw") in proc.stderr


def digest(directory) -> dict:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(directory).rglob("*")) if p.is_file()}


def latest(directory) -> int:
    return int(open(os.path.join(directory, LATEST)).read())


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A --save directory holding iterations 5 and 10 of the tiny model (fp32)."""
    d = tmp_path_factory.mktemp("ck") / "ck_typo"
    proc = torchrun("--train-iters", "10", "--save", d, "--save-interval", "5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert latest(d) == 10 and {"iter_0000005", "iter_0000010"} <= set(os.listdir(d))
    return d


def copy_of(checkpoints, tmp_path, name="ck"):
    shutil.copytree(checkpoints, tmp_path / name)
    return tmp_path / name


# -- runaway processes ----------------------------------------------------------------------------
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGUSR1])
def test_workers_exit_within_seconds_when_torchrun_dies(tmp_path, sig):
    ck = tmp_path / "ck"
    launcher = subprocess.Popen(TORCHRUN + TINY + ["--train-iters", "100000", "--save", ck,
                                                   "--save-interval", "1"],
                                cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        for line in launcher.stdout:
            if interval_fields(line):
                break
        workers = children(launcher.pid)
        assert len(workers) == 2, workers
        launcher.send_signal(sig)
        deadline = time.monotonic() + 10
        while any(map(alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(map(alive, workers)), "a worker outlived torchrun by 10 s"
        before = digest(ck)
        time.sleep(1.5)
        assert digest(ck) == before, "nothing is written after the workers are gone"
        err = launcher.stderr.read()  # the workers' (torchrun died without a word)
        assert "Traceback" not in err, err[-3000:]  # the survivor of the first exit: one line
        assert len([x for x in err.splitlines() if x.startswith("error: ")]) >= 2, err[-3000:]
    finally:
        for pid in [launcher.pid] + children(launcher.pid):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        launcher.wait()


# -- start-up checks: exit 2, one line, the checkpoints untouched ---------------------------------
def test_load_typo_is_an_error_and_the_checkpoints_stay_byte_identical(checkpoints, tmp_path):
    ck = copy_of(checkpoints, tmp_path, "ck_typo")
    before = digest(ck)
    proc = torchrun("--train-iters", "12", "--save-interval", "5", "--load",
                    tmp_path / "ck_tpyo", "--save", ck)
    assert proc.returncode != 0
    assert errors(proc) == [f"error: --load {tmp_path / 'ck_tpyo'} does not exist: fix the "
                            "path, or pass the same directory to --load and --save to start a "
                            "new job"] * 2
    assert not our_traceback(proc) and "iteration" not in proc.stdout
    assert digest(ck) == before


def _front_door(argv, monkeypatch, capsys, world=2, base=TINY):
    """pretrain.parse on rank 0 of `world` (no process group): (exit code, stdout, stderr
    lines)."""
    from megatron_2bw.pretrain import parse
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    try:
        parse("gpt", base + [str(a) for a in argv])
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err.splitlines()


@pytest.mark.parametrize("case,flags,line", [
    ("newer", ["--train-iters", "20", "--save", "{ck}"],
     "error: --save {ck} already holds iteration 10, newer than this run's start from scratch "
     "(no --load): resume with --load {ck}, or save this run elsewhere"),
    ("iters", ["--train-iters", "5", "--load", "{ck}", "--save", "{ck}"],
     "error: --train-iters 5 is below iteration 10 of the checkpoint in --load {ck}: raise "
     "--train-iters above 10, or load another checkpoint"),
    ("no-latest", ["--train-iters", "5", "--load", "{ck}/iter_0000010"],
     "error: --load {ck}/iter_0000010 holds no checkpoint (no latest_checkpointed_iteration.txt):"
     " fix the path, or pass the same directory to --load and --save to start a new job"),
])
def test_start_up_checks_refuse_and_leave_the_checkpoints_intact(checkpoints, tmp_path,
                                                                 monkeypatch, capsys, case,
                                                                 flags, line):
    ck = copy_of(checkpoints, tmp_path)
    before = digest(ck)
    code, _, err = _front_door([f.format(ck=ck) for f in flags], monkeypatch, capsys)
    assert (code, err) == (2, [line.format(ck=ck)])
    assert digest(ck) == before


def test_save_under_a_regular_file_fails_at_start_up(tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("x")
    code, _, err = _front_door(["--save", tmp_path / "file" / "ck"], monkeypatch, capsys)
    assert code == 2 and err == [f"error: --save {tmp_path / 'file' / 'ck'} cannot be created "
                                 "(Not a directory): choose a directory you can write"]
    code, _, err = _front_door(["--save", tmp_path / "file"], monkeypatch, capsys)
    assert code == 2 and err == [f"error: --save {tmp_path / 'file'} is a file, not a "
                                 "directory: choose a directory"]


def test_load_equal_to_save_is_the_first_start_of_a_job(tmp_path, monkeypatch, capsys):
    ck = tmp_path / "new"
    code, out, err = _front_door(["--load", ck, "--save", ck], monkeypatch, capsys)
    assert code == 0 and err == []
    assert out.splitlines() == [f"--load {ck} holds no checkpoint yet and equals --save: "
                                "starting from scratch (the first start of this job)"]
    assert ck.is_dir(), "--save is created at start-up"


# -- numerics -------------------------------------------------------------------------------------
def test_diverged_fp16_run_ends_with_one_line_and_writes_no_nonfinite_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    scale = ("--initial-loss-scale", str(2 ** 16))  # the skip counts below start from 2^16
    proc = torchrun("--fp16", *scale, "--lr", "1e6", "--train-iters", "40", "--save", ck,
                    "--save-interval", "5")
    assert proc.returncode != 0
    assert not our_traceback(proc)
    lines = errors(proc)
    assert lines and all("are not finite in torch.float16" in x and
                                   "no checkpoint written" in x for x in lines), lines
    for directory in ck.glob("iter_*"):  # torch_dist: both 2BW versions of every tensor
        for prefix in ("model.", "model_previous."):
            tensors = read_full(str(directory), prefix)
            assert tensors and all(torch.isfinite(t).all() for t in tensors.values()), prefix
    assert not (ck / LATEST).exists() or latest(ck) < 40
    # without --save the skip limit ends the run: 27 skips in a row are allowed by default
    proc = torchrun("--fp16", *scale, "--lr", "1e6", "--train-iters", "40")
    assert proc.returncode != 0 and not our_traceback(proc)
    lines = errors(proc)
    assert lines and all("fp16 skipped 28 steps in a row" in x for x in lines), lines


# -- interrupted and failed saves -----------------------------------------------------------------
def test_kill_during_save_leaves_temporary_files_the_next_start_removes(tmp_path):
    ck = tmp_path / "ck"
    proc = torchrun("--train-iters", "6", "--save", ck, "--save-interval", "2",
                    inject="kill-in-save:1:4")
    assert proc.returncode != 0
    assert latest(ck) == 2
    leftovers = temporary_files(str(ck))
    assert leftovers and all(os.path.basename(p).startswith(TMP_PREFIX) for p in leftovers)
    (ck / "notes.tmp-keep").write_text("not ours")
    proc = torchrun("--train-iters", "6", "--load", ck, "--save", ck)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [f"removed {p}: the leftover of a checkpoint write that was killed"
            for p in leftovers] == [x for x in proc.stdout.splitlines() if x.startswith("removed")]
    assert temporary_files(str(ck)) == [] and (ck / "notes.tmp-keep").exists()
    assert latest(ck) == 6


def test_corrupted_checkpoint_is_one_line_per_rank_without_traceback(checkpoints, tmp_path):
    ck = copy_of(checkpoints, tmp_path)
    path = ck / "iter_0000010" / "__1_0.distcp"  # the second stage's shards (torch_dist)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    before = digest(ck)
    proc = torchrun("--train-iters", "12", "--load", ck, "--save", ck)
    assert proc.returncode != 0
    assert not our_traceback(proc)
    lines = errors(proc)
    assert lines and all(f"checkpoint file {path} does not match its checksum" in x
                                   for x in lines), lines
    assert digest(ck) == before


def _can_mount_tmpfs() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs none /mnt"],
                              capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs unshare -rm to mount a small tmpfs")
def test_disk_full_during_a_save_names_enospc_and_keeps_the_previous_checkpoint(tmp_path):
    """A 1.5 MB tmpfs holds the checkpoint of iteration 2 (about 1 MB), not that of 4."""
    ck = tmp_path / "ck"
    ck.mkdir()
    cmd = " ".join(TORCHRUN + TINY + ["--train-iters", "6", "--save", str(ck),
                                      "--save-interval", "2"])
    script = (f"mount -t tmpfs -o size=1500k none {ck} && {cmd}; echo rc=$?; "
              f"cat {ck}/{LATEST}; cd {ck} && find . -type f | sort")
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)  # bounds a hang
    tail = proc.stdout.split("rc=")[1].split()
    assert tail[:2] == ["1", "2"], proc.stdout[-2000:] + proc.stderr[-3000:]
    assert not our_traceback(proc)
    lines = errors(proc)
    assert lines and all("No space left on device (ENOSPC)" in x and
                                   f"the previous checkpoint (iteration 2) in {ck} is intact"
                                   in x for x in lines), lines
    files = tail[2:]
    assert all(f.startswith("./iter_0000002/") for f in files if f != f"./{LATEST}"), files
    assert len(files) == 6, "iteration 2 (torch_dist: .metadata, two ranks' shards, common.pt, " \
        "checksums.sha256) and latest"


# -- resume with another precision ----------------------------------------------------------------
def test_resume_with_another_precision_starts_a_fresh_loss_scaler(checkpoints, tmp_path):
    ck = copy_of(checkpoints, tmp_path)
    proc = torchrun("--fp16", "--initial-loss-scale", str(2 ** 16), "--train-iters", "12",
                    "--load", ck, "--save", ck)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"checkpoint {ck} (iteration 10) was saved with fp32; continuing with fp16 (dynamic " \
           "loss scale): the loss scaler starts fresh" in proc.stdout
    scales = [f["loss scale"] for f in map(interval_fields, proc.stdout.splitlines()) if f]
    assert scales == [65536.0] * 2, "2 ** 16 as the log prints it (Megatron's {:.1f})"
    proc = torchrun("--bf16", "--train-iters", "14", "--load", ck, "--save", ck)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"checkpoint {ck} (iteration 12) was saved with fp16 (dynamic loss scale); " \
           "continuing with bf16: the loss scaler starts fresh" in proc.stdout
    assert all(f["loss scale"] == 1.0 for f in map(interval_fields, proc.stdout.splitlines())
               if f)
    assert latest(ck) == 14
