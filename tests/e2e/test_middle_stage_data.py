"""A middle pipeline stage reads no data (issue 29, point 5) and still trains and evaluates in
step with the stages that do: three torchrun ranks, d=3, on an indexed dataset with a
validation split (the middle stage sizes the splits from the .idx header alone;
tests/unit/test_data_startup.py shows it opens nothing else and decides "no validation data"
as the data ranks do). The data check's verdict and each split's sample indices are built
once (one completion marker each)."""
import os
import subprocess
import sys
from pathlib import Path

from test_data_gpt import make_dataset

ROOT = Path(__file__).resolve().parents[2]


def test_three_stages_on_indexed_data_train_and_evaluate_together(tmp_path):
    data = make_dataset(tmp_path / "d", num_docs=200)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "3", str(ROOT / "pretrain_gpt.py"), "--num-layers", "3", "--hidden-size", "32",
           "--num-attention-heads", "2", "--seq-length", "16", "--micro-batch-size", "1",
           "--global-batch-size", "4", "--train-iters", "2", "--eval-interval", "1",
           "--eval-iters", "1", "--pipeline-model-parallel-size", "3", "--pipeline-schedule",
           "flush", "--data-path", data, "--tokenizer-type", "NullTokenizer", "--vocab-size",
           "200000", "--split", "80,20,0", "--data-cache-path", str(tmp_path / "c"),
           "--log-interval", "1"]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(WANDB_MODE="offline", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sum(line.startswith(" validation loss at iteration ")
               for line in proc.stdout.splitlines()) == 2, proc.stdout
    kinds = sorted(p.name.split("-")[1] for p in (tmp_path / "c").glob("*-description.json"))
    assert kinds == ["DataCheck", "GPTDataset", "GPTDataset"]  # the check; train and valid
