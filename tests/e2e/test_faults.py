"""Fault injection: no hangs, no lost work, clear errors (issue: reliability).

Faults are injected by passing a hooks object (tests/fault_hooks.py): to training.train through
test_resume.run, or to pretrain.main through tests/fault_entry.py --inject KIND:RANK:ITERATION.
The table of faults and their guarantees continues in test_fault_table.py."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

from fault_hooks import InjectedFault
from megatron_2bw.checkpoint.api import LATEST
from megatron_2bw.training.spawn import free_port, spawn
from test_resume import _worker, make_cfg, run
from log_lines import interval_fields

ROOT = Path(__file__).resolve().parents[2]
ENTRY = str(ROOT / "tests" / "fault_entry.py")
SMALL = ["--mock-data", "--pipeline-model-parallel-size", "2", "--num-layers", "2",
         "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--micro-batch-size", "2", "--global-batch-size", "8", "--log-interval", "1"]


def _env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["WANDB_MODE"] = "offline"
    return env


def _single_process_env():
    """A world of one still opens a rendezvous port: a free one, not the shared default 29500."""
    return dict(_env(), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def test_killed_rank_stops_the_others_under_torchrun(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc_per_node", "2", ENTRY, "--inject", "kill:1:3", *SMALL,
                             "--train-iters", "50", "--distributed-timeout-minutes", "0.5"],
                            cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # every worker is up and training; rank 1 dies at iteration 3
            if interval_fields(line):
                break
        t0 = time.monotonic()  # from here, not from start-up (which load stretches)
        proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0
    assert time.monotonic() - t0 < 120


def test_surviving_rank_exits_within_the_timeout_naming_itself_and_the_peer(tmp_path):
    """Plain processes (no launcher to clean up): rank 1 dies, rank 0 must not hang. Timed from
    rank 1's death, not from start-up (which load stretches)."""
    port, timeout_min = free_port(), 0.25
    procs, errs = [], [tmp_path / "stderr.0", tmp_path / "stderr.1"]
    try:
        for rank in (0, 1):
            env = _env()
            env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            with open(errs[rank], "w") as err:
                procs.append(subprocess.Popen(
                    [sys.executable, ENTRY, "--inject", "kill:1:3", *SMALL, "--train-iters",
                     "50", "--distributed-timeout-minutes", str(timeout_min)],
                    cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err))
        procs[1].wait(timeout=300)  # start-up and three iterations: only bounds a hang
        died = time.monotonic()
        procs[0].wait(timeout=2 * 60 * timeout_min + 60)
        survived = time.monotonic() - died
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert procs[1].returncode == -signal.SIGKILL, errs[1].read_text()[-2000:]
    assert procs[0].returncode == 1, errs[0].read_text()[-2000:]
    assert survived < 2 * 60 * timeout_min + 45
    survivor = errs[0].read_text()
    assert "Traceback" not in survivor, survivor[-3000:]  # a peer's death: one line, no chain
    lines = [x for x in survivor.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1 and survivor.strip().splitlines()[-1] == lines[0], survivor[-2000:]
    assert lines[0].startswith("error: rank 0 (stage 0/2") and "failed" in lines[0] and \
        "rank 1 (stage 1/2" in lines[0], lines[0]


def test_raising_rank_is_named(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc_per_node", "2", ENTRY, "--inject", "raise:1:2", *SMALL,
                           "--train-iters", "20", "--distributed-timeout-minutes", "0.5"],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0
    assert "error: rank 1 (stage 1/2" in proc.stderr and "injected failure" in proc.stderr
    assert str(ROOT / "megatron_2bw" / "training/loop.py") in proc.stderr, \
        "an unexpected error keeps its traceback"


def _latest(d):
    return int(open(os.path.join(d, LATEST)).read())


def test_kill_during_save_keeps_the_previous_checkpoint_and_resume_is_exact(tmp_path):
    d = str(tmp_path)
    full = run(make_cfg(["--train-iters", "6"]), f"{d}/full")
    with pytest.raises(ProcessExitedException, match="signal SIGKILL"):
        run(make_cfg(["--train-iters", "6", "--save", f"{d}/ck", "--save-interval", "2"]),
            f"{d}/killed", hooks=InjectedFault("kill-in-save", 1, 4))
    assert _latest(f"{d}/ck") == 2, "latest still names the last complete checkpoint"
    rest = run(make_cfg(["--train-iters", "6", "--save", f"{d}/ck", "--load", f"{d}/ck"]),
               f"{d}/rest")
    assert rest == full[2:]


@pytest.mark.parametrize("sig", ["sigterm", "sigint"])
def test_signal_saves_exits_cleanly_and_resume_is_exact(tmp_path, sig):
    d = str(tmp_path)
    full = run(make_cfg(["--train-iters", "6"]), f"{d}/full")
    first = run(make_cfg(["--train-iters", "6", "--save", f"{d}/ck"]), f"{d}/first",
                hooks=InjectedFault(sig, 0, 3))
    # signalled after iteration 3: the request rides in batch 4's reductions and every rank
    # acts on it after iteration 5 (pipeline/flags.py: no collective of its own)
    assert len(first) == 5 and _latest(f"{d}/ck") == 5
    rest = run(make_cfg(["--train-iters", "6", "--save", f"{d}/ck", "--load", f"{d}/ck"]),
               f"{d}/rest")
    assert first + rest == full


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_real_signal_to_a_run_checkpoints_and_exits_zero(tmp_path, sig):
    """SIGINT (Ctrl-C) behaves like SIGTERM: a final checkpoint, exit 0, no traceback."""
    ck = tmp_path / "ck"
    proc = subprocess.Popen([sys.executable, str(ROOT / "pretrain_gpt.py"), "--mock-data",
                             "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
                             "4", "--seq-length", "16", "--train-iters", "100000",
                             "--save", str(ck), "--log-interval", "1"],
                            cwd=ROOT, env=_single_process_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if interval_fields(line):
            break
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert f"{sig.name}: saved a checkpoint" in out
    assert "Traceback" not in err
    assert _latest(ck) >= 1


def test_ctrl_c_without_save_is_one_line_and_exit_130(tmp_path):
    proc = subprocess.Popen([sys.executable, str(ROOT / "pretrain_gpt.py"), *SMALL[:1],
                             *SMALL[3:], "--train-iters", "100000"],
                            cwd=ROOT, env=_single_process_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if interval_fields(line):
            break
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-3000:]
    assert err.strip().splitlines() == ["error: rank 0 (stage 0/1, data-parallel replica 0, "
                                        "tensor rank 0) aborted by SIGINT: no checkpoint of this "
                                        "point (one Ctrl-C saves one when --save is set)"]


_FINALIZER_GETS_SIGINT = """
import signal, sys
from megatron_2bw.training.reliability import abort_on_sigint
# Python's own Ctrl-C handler whatever this process inherited: a shell starts a background job
# (`pytest ... &`) with SIGINT ignored, and Python then installs no handler of its own
signal.signal(signal.SIGINT, signal.default_int_handler)
if sys.argv[1] == "abort":
    abort_on_sigint("error: aborted by SIGINT")
class Finalized:
    def __del__(self):
        signal.raise_signal(signal.SIGINT)  # to this thread; its handler has run on return
Finalized()
print("still running", flush=True)
"""


@pytest.mark.parametrize("handler", ["python", "abort"])
def test_ctrl_c_inside_a_finalizer_still_stops_the_run(handler):
    """Python drops a KeyboardInterrupt raised inside a finalizer and goes on (the cause of a run
    that ignored Ctrl-C once); the training ranks' SIGINT handler exits anyway. The finalizer
    signals itself (no timing), under Python's handler whatever SIGINT the test run inherited."""
    proc = subprocess.run([sys.executable, "-c", _FINALIZER_GETS_SIGINT, handler], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=120)
    if handler == "python":
        assert (proc.returncode, proc.stdout) == (0, "still running\n"), proc.stderr[-2000:]
        assert "Exception ignored in: <function Finalized.__del__" in proc.stderr, \
            proc.stderr[-2000:]
        assert proc.stderr.rstrip().splitlines()[-1].startswith("KeyboardInterrupt"), \
            proc.stderr[-2000:]
    else:
        assert (proc.returncode, proc.stdout) == (130, ""), proc.stderr[-2000:]
        assert proc.stderr.splitlines() == ["error: aborted by SIGINT"]


def test_corrupted_shard_is_a_clear_error(tmp_path):
    d = str(tmp_path)
    run(make_cfg(["--train-iters", "2", "--save", d]), f"{d}/x")
    path = os.path.join(d, "iter_0000002", "__1_0.distcp")  # stage 1's shards (torch_dist)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))
    with pytest.raises(ProcessRaisedException, match="does not match its checksum"):
        spawn(_worker, 2, args=(make_cfg(["--train-iters", "3", "--load", d]), f"{d}/y"),
              timeout_minutes=1)


def test_nan_loss_in_fp32_is_a_clear_error(tmp_path):
    # the window of iteration 3 already runs forwards of iteration 4 (2BW), so either may be hit
    with pytest.raises(ProcessRaisedException, match="loss is nan at iteration [34] on rank"):
        run(make_cfg(["--train-iters", "6"]), f"{tmp_path}/n", hooks=InjectedFault("nan", 1, 3))


def test_keep_last_prunes_old_checkpoints(tmp_path):
    d = str(tmp_path)
    run(make_cfg(["--train-iters", "6", "--save", d, "--save-interval", "1", "--keep-last",
                  "2"]), f"{d}/k")
    assert sorted(x for x in os.listdir(d) if x.startswith("iter_")) == \
        ["iter_0000005", "iter_0000006"]
