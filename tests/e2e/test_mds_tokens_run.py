"""pretrain_gpt.py with Megatron-DeepSpeed's token flags: --train-tokens ends the run where its
loop does, and every log line's lr is its scheduler's (the reference:
tests/unit/test_mds_lr_tokens.py)."""
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_2bw.training.observe.log_line import parse_line

from test_mds_lr_tokens import B, S, MegatronDeepSpeedScheduler, logged_lrs

ROOT = Path(__file__).resolve().parents[2]


def test_a_run_logs_the_token_schedule_and_stops_at_its_tokens(tmp_path):
    """pretrain_gpt.py itself: --train-tokens 200 of 64 an iteration ends the run after 4 of the
    10 iterations given, and every log line's lr is Megatron-DeepSpeed's."""
    flags = ["--train-iters", "10", "--train-tokens", "200", "--lr-warmup-tokens", "100",
             "--lr-decay-tokens", "600", "--lr-decay-style", "linear"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "pretrain_gpt.py"), "--mock-data", "--num-layers", "1",
         "--hidden-size", "32", "--num-attention-heads", "4", "--global-batch-size", str(B),
         "--seq-length", str(S), "--lr", "0.1", "--min-lr", "0.01", "--log-interval", "1",
         *flags], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={"PATH": "/usr/bin:/bin", "WANDB_MODE": "offline", "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "run summary | iterations 4 (0->4) | samples 16 | tokens 256" in proc.stdout
    lines = [parse_line(line) for line in proc.stdout.splitlines()]
    lrs = [fields["learning rate"] for _, fields in filter(None, lines)
           if "learning rate" in fields]
    want = logged_lrs(MegatronDeepSpeedScheduler(0.1, 0.01, 0, 10 * B, "linear", 100, 600), 4)
    assert lrs == pytest.approx(want, rel=1e-3, abs=1e-12) and len(lrs) == 4
