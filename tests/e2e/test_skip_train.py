"""Megatron's --skip-train: no training, --eval-iters validation batches on the weights of --load
(the same loss the run logged when it evaluated them), no checkpoint written, and a command that
could evaluate nothing refused in one line before any process group."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--log-interval", "1", "--eval-iters", "2"]


def run(args, cwd, stages=1):
    launch = [] if stages == 1 else ["-m", "torch.distributed.run", "--standalone",
                                     "--nproc_per_node", str(stages)]
    return subprocess.run([sys.executable, *launch, str(ROOT / "pretrain_gpt.py"), *TINY,
                           "--pipeline-model-parallel-size", str(stages), *args],
                          cwd=cwd, capture_output=True, text=True, timeout=180,
                          env={"PATH": "/usr/bin:/bin", "WANDB_MODE": "offline",
                               "HOME": str(cwd)})


def validation(out: str) -> list[str]:
    return re.findall(r"^ validation loss at iteration (\d+)(?: on validation set)? \| "
                      r"lm loss value: ([0-9.E+-]+) \|", out, re.M)


@pytest.mark.parametrize("stages", [1, 2], ids=["one-process", "2bw-d2"])
def test_skip_train_evaluates_the_loaded_weights_and_trains_nothing(tmp_path, stages):
    ckpt = tmp_path / "ckpt"
    trained = run(["--train-iters", "3", "--eval-interval", "3", "--save", str(ckpt)], tmp_path,
                  stages)
    assert trained.returncode == 0, trained.stderr[-2000:]
    [(it, loss)] = validation(trained.stdout)
    assert it == "3"
    before = sorted(p.name for p in ckpt.iterdir())
    skipped = run(["--train-iters", "3", "--skip-train", "--load", str(ckpt), "--save",
                   str(ckpt)], tmp_path, stages)
    assert skipped.returncode == 0, skipped.stderr[-2000:]
    assert validation(skipped.stdout) == [("3", loss)]  # the weights the run evaluated
    assert "consumed samples" not in skipped.stdout  # no training iteration
    assert "run summary | iterations 0 (3->3) | samples 0" in skipped.stdout
    assert sorted(p.name for p in ckpt.iterdir()) == before  # nothing written


def test_skip_train_with_nothing_to_evaluate_is_one_line(tmp_path):
    for extra, message in (
            (["--eval-iters", "0"], "--skip-train evaluates --eval-iters batches and trains "
                                    "none: give --eval-iters >= 1, got 0"),):
        proc = run(["--train-iters", "1", "--skip-train", *extra], tmp_path)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr.strip().splitlines()[-1].endswith(message)
