"""wandb runs offline by default and its run directory holds the logged loss history."""
import glob
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("wandb")
from megatron_2bw.testing.wandb_offline import read_history  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_offline_run_directory_holds_the_loss_history(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "RANK",
                                                                    "WORLD_SIZE", "LOCAL_RANK"))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "pretrain_gpt.py"), "--mock-data", "--pipeline-model-parallel-size", "2",
           "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
           "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
           "--train-iters", "6", "--log-interval", "2", "--save", str(tmp_path / "ckpt"),
           "--wandb-project", "test", "--wandb-exp-name", "offline"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    console = [float(x) for x in re.findall(r"\| lm loss ([0-9.]+) \|", proc.stdout)]
    runs = glob.glob(str(tmp_path / "ckpt" / "wandb" / "wandb" / "offline-run-*"))
    assert len(runs) == 1, "an offline run under {save}/wandb"
    history = [row for row in read_history(runs[0]) if "lm loss" in row]
    assert [row["_step"] for row in history] == [1, 2, 3, 4, 5, 6]  # Megatron's: per iteration
    per_iteration = [row["lm loss"] for row in history]
    means = [(a + b) / 2 for a, b in zip(per_iteration[::2], per_iteration[1::2])]
    assert means == pytest.approx(console, abs=1e-3)  # the line: the interval's mean
