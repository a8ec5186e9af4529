"""A frozen rank ends the job (issue 29, point 1): under torchrun, rank 1 stops itself with
SIGSTOP after iteration 3 (tests/fault_hooks.py "freeze": its sockets stay open, so rank 0 sees
silence, not a death). With --distributed-timeout-minutes 0.1 the job must end within the
timeout plus a minute of the freeze, and rank 0 must print one line naming rank 1 and what it
waited on, with no traceback (each worker's stderr is its own file: torchrun --redirects).

Before issue 29 the stage-pair groups had gloo's default timeout (30 min): rank 0 printed
nothing for 240 s with a 1 minute timeout."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procs import alive, children, state

ROOT = Path(__file__).resolve().parents[2]
ENTRY = str(ROOT / "tests" / "fault_entry.py")
TINY = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--log-interval", "1", "--train-iters", "100000", "--distributed-timeout-minutes", "0.1"]
TIMEOUT_S = 6


def _env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(WANDB_MODE="offline", PYTHONPATH=str(ROOT))
    return env


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("layout,waited", [
    (["--pipeline-model-parallel-size", "2"], "rank 1 (stage 1/2, data-parallel replica 0"),
    pytest.param([], "rank 1 (stage 0/1, data-parallel replica 1", marks=pytest.mark.slow),
], ids=["stage-pair", "data-parallel"])
def test_a_frozen_rank_ends_the_job_and_its_peer_says_whom_it_waited_for(tmp_path, layout,
                                                                          waited):
    logs = tmp_path / "logs"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "--log-dir", str(logs), "--redirects", "2", ENTRY, "--inject", "freeze:1:3", *TINY,
         *layout], cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True)
    try:
        deadline = time.monotonic() + 300  # start-up and three iterations: only bounds a hang
        while time.monotonic() < deadline and launcher.poll() is None:
            if any(state(pid) == "T" for pid in children(launcher.pid)):
                break
            time.sleep(0.1)
        frozen = time.monotonic()
        assert launcher.poll() is None, launcher.stderr.read()[-3000:]
        launcher.wait(timeout=TIMEOUT_S + 90)
        ended = time.monotonic() - frozen
    finally:
        for pid in [launcher.pid] + children(launcher.pid):
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        launcher.wait()
    print(f"\nthe job ended {ended:.0f} s after rank 1 froze (timeout {TIMEOUT_S} s)")
    assert launcher.returncode != 0
    assert ended < TIMEOUT_S + 60, f"the job ended {ended:.0f} s after rank 1 froze"
    rank0 = next(logs.rglob("attempt_0/0/stderr.log")).read_text()
    assert "Traceback" not in rank0, rank0[-3000:]
    lines = [x for x in rank0.splitlines() if x.strip()]
    errors = [x for x in lines if x.startswith("error: ")]
    assert len(errors) == 1, rank0[-3000:]
    assert errors[0].startswith("error: rank 0 (stage 0/") and \
        f"timed out after {TIMEOUT_S} s waiting for {waited}" in errors[0] and \
        "raise --distributed-timeout-minutes" in errors[0], errors[0]
