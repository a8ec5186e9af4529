"""Preemption on SLURM with the shipped batch scripts (issue 29, point 2), run unedited by bash
with a fake srun/scontrol first on PATH (tests/fake_slurm: srun signals every process of its
step, as slurmstepd does; scontrol expands host lists and records requeues).

Each script trains a tiny GPT on 2 local processes (MODEL_ARGS, TRAIN_ITERS, CKPT, MASTER_PORT:
variables the scripts read) with iterations of about 15 s (the test hook SlowIterations through
tests/fault_entry.py: the fake srun puts it in place of pretrain_gpt.py). USR1 goes to the batch
shell only, mid-iteration, as `#SBATCH --signal=B:USR1@N` sends it. Then: a checkpoint before
--train-iters, exit 0, a requeue seen by scontrol; and the same script run again resumes from
`latest` by itself (log line) and finishes without another requeue."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_2bw.checkpoint.api import LATEST
from megatron_2bw.training.spawn import free_port

ROOT = Path(__file__).resolve().parents[2]
FAKE_SLURM = ROOT / "tests" / "fake_slurm"
TINY = ("--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--pipeline-model-parallel-size 2 --micro-batch-size 2 --global-batch-size 4 "
        "--mock-data")
EXTRA = ["--log-interval", "1", "--lr-warmup-iters", "0", "--wandb-project", "",
         "--no-memory-check"]
TRAIN_ITERS = 6
ITERATION_S = 15


def _job_env(tmp_path: Path, script: str, job_id: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    tasks = "1" if "srun" not in script else "2"  # torchrun: one task per node, 2 workers
    path = os.pathsep.join([str(FAKE_SLURM), os.path.dirname(sys.executable), env["PATH"]])
    env.update(PATH=path, WANDB_MODE="offline",  # python and torchrun: this interpreter's
               SLURM_JOB_ID=str(job_id), SLURM_JOB_NODELIST="localhost",
               SLURM_JOB_NUM_NODES="1", SLURM_GPUS_ON_NODE="2", SLURM_NTASKS=tasks,
               SLURM_NTASKS_PER_NODE=tasks, SLURM_SUBMIT_DIR=str(ROOT),
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
               CKPT=str(tmp_path / "ckpt"), TRAIN_ITERS=str(TRAIN_ITERS), MODEL_ARGS=TINY,
               FAKE_SLURM_LOG=str(tmp_path / "slurm.log"))
    return env


def _run_job(script: str, env: dict, signal_mid_iteration: int | None, seconds: float = 0,
             timeout: float = 240):
    """bash SCRIPT as the batch step; with `signal_mid_iteration`, USR1 to the batch shell a few
    seconds into that iteration (of `seconds`). Returns (exit status, output)."""
    proc = subprocess.Popen(["bash", str(ROOT / "examples" / "slurm" / script), *EXTRA],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines, deadline = [], time.monotonic() + timeout
    try:
        for line in proc.stdout:
            lines.append(line)
            if signal_mid_iteration and \
                    line.startswith(f"slow iteration {signal_mid_iteration}:"):
                time.sleep(min(3.0, seconds / 2))  # inside that slow iteration
                proc.send_signal(signal.SIGUSR1)
                signal_mid_iteration = None
            if time.monotonic() > deadline:
                break
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:  # a hang: stop the whole job (its own session)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, "".join(lines)


@pytest.mark.parametrize("script,iteration_s", [
    pytest.param("pretrain_gpt_2bw.sbatch", ITERATION_S, marks=pytest.mark.slow),  # ~70 s
    pytest.param("pretrain_gpt_srun.sbatch", ITERATION_S, marks=pytest.mark.slow),  # ~65 s
    ("pretrain_gpt_2bw.sbatch", 2),  # the default run's copy: the same path, short iterations
])
def test_usr1_mid_iteration_saves_exits_0_requeues_and_the_rerun_resumes(tmp_path, script,
                                                                         iteration_s):
    job_id = 4242
    env = _job_env(tmp_path, script, job_id)
    slow = dict(env, FAKE_SRUN_ENTRY=f"{ROOT / 'tests' / 'fault_entry.py'} --slow-iterations "
                                     f"{iteration_s}")
    t0 = time.monotonic()
    rc, out = _run_job(script, slow, signal_mid_iteration=1, seconds=iteration_s)
    first_s = time.monotonic() - t0
    assert rc == 0, out[-3000:]
    saved = int((tmp_path / "ckpt" / LATEST).read_text())
    assert 1 <= saved < TRAIN_ITERS, out[-3000:]
    assert f"SIGUSR1: saved a checkpoint at iteration {saved}" in out, out[-3000:]
    assert "Traceback" not in out and "Signals.SIGUSR1" not in out, out[-3000:]
    log = (tmp_path / "slurm.log").read_text().splitlines()
    assert log.count(f"requeue {job_id}") == 1, log
    # the requeued job: the same script, same variables, normal speed
    t0 = time.monotonic()
    rc, out = _run_job(script, env, signal_mid_iteration=None)
    assert rc == 0, out[-3000:]
    assert f"loading checkpoint from {tmp_path / 'ckpt'} at iteration {saved}" in out, \
        out[-3000:]
    assert int((tmp_path / "ckpt" / LATEST).read_text()) == TRAIN_ITERS
    log = (tmp_path / "slurm.log").read_text().splitlines()
    assert log.count(f"requeue {job_id}") == 1, log  # finished: no second requeue
    print(f"{script}, {iteration_s} s iterations: preempted run {first_s:.0f} s (saved "
          f"iteration {saved}), resumed run {time.monotonic() - t0:.0f} s")


def test_exit_duration_counts_from_process_start(tmp_path):
    """--exit-duration-in-mins counts start-up too, as Megatron's does: 4 s spent before the
    loop (SlowStart: after the engine is built, before loading) against a 3 s budget stop the
    run at the first boundary where the ranks can agree (iteration 3 at the latest), where a
    clock started at the loop would train 3 s worth of tiny iterations. Exit 0, a checkpoint."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK") and not k.startswith("SLURM_")}
    env.update(WANDB_MODE="offline", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    out = subprocess.run([sys.executable, str(ROOT / "tests" / "fault_entry.py"), "--slow-start",
                          "4", *TINY.replace("--pipeline-model-parallel-size 2", "").split(),
                          "--train-iters", "100000", "--exit-duration-in-mins", "0.05",
                          "--save", str(tmp_path / "ck"), "--log-interval", "1",
                          "--no-memory-check"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    assert 1 <= int((tmp_path / "ck" / LATEST).read_text()) <= 3, out.stdout[-2000:]


def test_usr1_during_start_up_is_kept_and_ends_in_a_checkpoint(tmp_path):
    """A USR1 that comes before training starts (here: right after the --load check, before the
    data and the process group) is held (reliability.hold_usr1), not lost or fatal: the run
    saves at the first agreed boundary and exits 0. Started with USR1 ignored, as the batch
    scripts start it; a lost signal would train all 50 iterations."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK") and not k.startswith("SLURM_")}
    env.update(WANDB_MODE="offline", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    ck = tmp_path / "ck"
    proc = subprocess.Popen(
        ["bash", "-c", 'trap "" USR1; exec "$@"', "ignore-usr1", sys.executable,
         str(ROOT / "tests" / "fault_entry.py"), "--slow-start", "2",
         *TINY.replace("--pipeline-model-parallel-size 2", "").split(), "--train-iters", "50",
         "--save", str(ck), "--load", str(ck), "--log-interval", "1", "--no-memory-check"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "holds no checkpoint yet" in line:  # parse(): before data and process group
                proc.send_signal(signal.SIGUSR1)
        proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = "".join(lines)
    assert proc.returncode == 0, out[-2000:]
    assert 1 <= int((ck / LATEST).read_text()) <= 3, out[-2000:]
    assert "SIGUSR1: saved a checkpoint at iteration" in out, out[-2000:]
