"""pretrain_gpt.py on Megatron's per-split data: it trains on --train-data-path and evaluates on
--valid-data-path (tests/unit/test_data_per_split.py checks the datasets)."""
import subprocess
import sys
from pathlib import Path

from indexed_data import write_documents as write

ROOT = Path(__file__).resolve().parents[2]
NULL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]


def test_pretrain_trains_on_one_and_evaluates_on_the_other(tmp_path):
    a, b = write(tmp_path / "a", 1, 40), write(tmp_path / "b", 60, 40)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "pretrain_gpt.py"), *NULL, "--train-data-path", a,
         "--valid-data-path", b, "--seq-length", "8", "--max-position-embeddings", "8",
         "--train-iters", "2", "--eval-interval", "2", "--eval-iters", "1",
         "--log-interval", "1"], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={"PATH": "/usr/bin:/bin", "WANDB_MODE": "offline", "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "validation loss" in proc.stdout and "iterations 2 (0->2)" in proc.stdout
