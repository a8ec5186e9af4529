"""The two other front doors of pretrain_*.py: a DeepSpeed JSON (same config as the equivalent
flags; a conflict names both) and --auto-plan (the planner picks a valid layout)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_2bw.pretrain import parse

ROOT = Path(__file__).resolve().parent.parent
MODEL = ["--mock-data", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16"]


@pytest.fixture
def world2(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")


def test_deepspeed_json_equals_the_equivalent_flags(tmp_path, world2):
    ds = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
          "gradient_clipping": 0.5, "steps_per_print": 5,
          "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "betas": [0.8, 0.95],
                                                     "eps": 1e-6, "weight_decay": 0.05}},
          "bf16": {"enabled": True}, "pipeline": {"schedule": "flush"}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    common = MODEL + ["--pipeline-model-parallel-size", "2"]
    from_json = parse("gpt", common + ["--deepspeed_config", str(path)])[0]
    from_flags = parse("gpt", common + [
        "--global-batch-size", "16", "--micro-batch-size", "2", "--clip-grad", "0.5",
        "--log-interval", "5", "--optimizer", "adam", "--lr", "2e-3", "--adam-beta1", "0.8",
        "--adam-beta2", "0.95", "--adam-eps", "1e-6", "--weight-decay", "0.05", "--bf16",
        "--pipeline-schedule", "flush"])[0]
    assert from_json.to_dict() == from_flags.to_dict()


def test_flag_conflicting_with_the_json_is_one_line_naming_both(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
                                "gradient_clipping": 0.5}))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), *MODEL,
                           "--clip-grad", "1.0", "--deepspeed_config", str(path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--clip-grad" in lines[0] and "gradient_clipping" in lines[0]


def test_auto_plan_picks_a_valid_layout_and_partition(world2, capsys):
    cfg = parse("gpt", MODEL + ["--auto-plan", "--global-batch-size", "16",
                                "--pipeline-schedule", "2bw", "--num-layers", "6"])[0]
    p = cfg.parallel
    assert p.tensor * p.pipeline * p.data == 2
    if p.pipeline > 1:
        assert p.partition[0] == 0 and p.partition[-1] == 8 and len(p.partition) == p.pipeline + 1
    assert "auto-plan:" in capsys.readouterr().out
