"""examples/slurm/preemption.sh, the part of the batch scripts that turns SLURM's USR1 into a
checkpoint, exit 0 and a requeue, with bash stand-ins for the training step and scontrol (bash
only: no Python process). The shipped scripts with real training: tests/e2e/
test_slurm_preemption.py."""
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LATEST = "latest_checkpointed_iteration.txt"
# a step that saves iteration $SAVED when USR1 comes, then exits $STEP_RC
STEP = ('trap \'echo "$SAVED" > "$CKPT/' + LATEST + '"; exit "$STEP_RC"\' USR1; '
        'touch "$CKPT/up"; while :; do sleep 0.05; done')


def _batch(tmp_path: Path, saved: int, step_rc: int, signal_it: bool, train_iters: int = 10,
           step: str = STEP, wait_up: bool = True):
    (tmp_path / "bin").mkdir(exist_ok=True)
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.write_text('#!/bin/bash\necho "$*" >> "$SLURM_LOG"\n')
    scontrol.chmod(0o755)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(exist_ok=True)
    env = dict(os.environ, PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}", CKPT=str(ckpt),
               SLURM_LOG=str(tmp_path / "slurm.log"), SLURM_JOB_ID="99", SAVED=str(saved),
               STEP_RC=str(step_rc), STEP=step)
    script = ("set -euo pipefail; source examples/slurm/preemption.sh; "
              f'run_preemptible "$CKPT" {train_iters} bash -c "$STEP"; echo "batch done"')
    proc = subprocess.Popen(["bash", "-c", script], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while not (ckpt / "up").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if signal_it:
            proc.send_signal(signal.SIGUSR1)  # what #SBATCH --signal=B:USR1@N sends
        elif not wait_up:  # the step signals the batch shell itself
            pass
        else:  # no preemption: the step ends by itself
            (ckpt / LATEST).write_text(f"{saved}\n")
            subprocess.run(["pkill", "-USR1", "-P", str(proc.pid)], check=False)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    log = (tmp_path / "slurm.log").read_text() if (tmp_path / "slurm.log").exists() else ""
    return proc.returncode, out, log


def test_usr1_is_forwarded_the_job_exits_0_and_requeues_before_train_iters(tmp_path):
    rc, out, log = _batch(tmp_path, saved=4, step_rc=0, signal_it=True)
    assert rc == 0 and "batch done" in out, out
    assert "forwarding it to the training step" in out
    assert "checkpoint at iteration 4 of 10" in out and "requeueing job 99" in out
    assert log == "requeue 99\n"


def test_no_requeue_when_the_save_reached_train_iters(tmp_path):
    rc, out, log = _batch(tmp_path, saved=10, step_rc=0, signal_it=True)
    assert rc == 0 and log == "", out


def test_a_failed_step_is_the_job_status_and_is_not_requeued(tmp_path):
    rc, out, log = _batch(tmp_path, saved=4, step_rc=3, signal_it=True)
    assert rc == 3 and "batch done" not in out and log == "", out


def test_usr1_before_the_steps_pid_is_known_is_forwarded_once_it_is(tmp_path):
    """SLURM's USR1 may reach the batch shell between starting the step and learning its pid
    (under load, the step can run first): the handler must not die on the unset pid (set -u:
    the batch shell would exit and leave the step running), and the signal still reaches the
    step. Deterministic half: the handler with no step yet; racy half: a step that signals the
    batch shell itself the moment it starts."""
    proc = subprocess.run(["bash", "-c", "set -euo pipefail; source examples/slurm/"
                           "preemption.sh; _forward_usr1; echo \"handled $PREEMPTED\""],
                          cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and "handled 1" in proc.stdout, proc.stderr
    early = STEP.replace("touch", 'kill -USR1 "$PPID"; touch')
    for _ in range(3):
        rc, out, log = _batch(tmp_path, saved=4, step_rc=0, signal_it=False, step=early,
                              wait_up=False)
        assert rc == 0 and "requeueing job 99" in out and log == "requeue 99\n", out
        (tmp_path / "slurm.log").unlink()


def test_without_usr1_nothing_is_requeued(tmp_path):
    # the step ends on its own (here: a USR1 sent to it directly, not through the batch shell)
    rc, out, log = _batch(tmp_path, saved=4, step_rc=0, signal_it=False)
    assert rc == 0 and "forwarding" not in out and log == "", out


@pytest.mark.parametrize("args,value", [
    (["--train-iters", "5"], "5"), (["--train-iters", "5", "--lr", "1", "--train-iters=7"], "7"),
    (["--train-iters=7", "--train-iters", "8"], "8"), (["--lr", "1"], ""),
])
def test_last_flag_value_is_the_flag_that_wins(args, value):
    out = subprocess.run(["bash", "-c", 'source examples/slurm/preemption.sh; '
                          'last_flag_value --train-iters "$@"', "bash", *args], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert out == value + "\n"
