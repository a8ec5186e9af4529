"""The two other front doors of pretrain_*.py: a DeepSpeed JSON (same config as the equivalent
flags; a conflict names both) and --auto-plan (the planner picks a valid layout, keeping what the
flags or the JSON fix), all through the one config pipeline (config_pipeline.build_config)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_2bw.pretrain import parse

ROOT = Path(__file__).resolve().parents[2]
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


# -- --auto-plan with a DeepSpeed JSON: one config pipeline (issue: the JSON was ignored) ----------
@pytest.fixture
def world4(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "0")


def _ds(tmp_path, **ds):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    return ["--deepspeed_config", str(path)]


def _one_line_exit(capsys, argv):
    with pytest.raises(SystemExit) as e:
        parse("gpt", argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1, err
    return err


def test_auto_plan_keeps_the_jsons_global_batch_and_schedule(tmp_path, world4, capsys):
    ds = _ds(tmp_path, train_batch_size=16, pipeline={"schedule": "flush"})
    cfg = parse("gpt", MODEL + ds + ["--auto-plan"]).cfg  # no "needs --global-batch-size"
    assert cfg.batch.global_batch_size == 16 and cfg.schedule == "flush"
    assert cfg.source_of("schedule") == "pipeline.schedule=flush in the DeepSpeed config"
    assert cfg.source_of("batch.global_batch_size") == \
        "train_batch_size=16 in the DeepSpeed config"
    assert "--pipeline-schedule flush" in capsys.readouterr().out
    # the same global batch by flag as well: still the JSON's schedule, not the default 2bw
    both = parse("gpt", MODEL + ds + ["--auto-plan", "--global-batch-size", "16"]).cfg
    assert both == cfg


def test_auto_plan_prefers_the_synchronous_schedule_on_one_stage(world4, capsys):
    """Nobody fixes the schedule: a one-stage layout is not trained with 2bw (only staleness)."""
    cfg = parse("gpt", MODEL + ["--auto-plan", "--global-batch-size", "16"]).cfg
    p = cfg.parallel
    assert p.tensor * p.pipeline * p.data == 4
    assert p.pipeline == 1 and cfg.schedule == "flush"  # the fastest layout here is d=1
    assert "warning" not in capsys.readouterr().out


def test_a_fixed_2bw_on_one_stage_is_kept_and_flagged(world4, capsys):
    cfg = parse("gpt", MODEL + ["--auto-plan", "--global-batch-size", "16",
                                "--pipeline-schedule", "2bw"]).cfg
    assert cfg.schedule == "2bw" and cfg.parallel.pipeline == 1
    out = capsys.readouterr().out
    assert "auto-plan: warning: the fastest layout has one pipeline stage, where 2bw (fixed by " \
           "--pipeline-schedule 2bw) only adds weight staleness" in out


def test_auto_plan_contradictions_name_both_sources(tmp_path, world4, capsys):
    ds = _ds(tmp_path, train_batch_size=16, gradient_accumulation_steps=1,
             pipeline={"schedule": "2bw"})
    err = _one_line_exit(capsys, MODEL + ds + ["--auto-plan", "--pipeline-model-parallel-size",
                                               "2"])
    for source in ("--pipeline-model-parallel-size 2",
                   "gradient_accumulation_steps=1 in the DeepSpeed config",
                   "pipeline.schedule=2bw in the DeepSpeed config"):
        assert source in err, err
    err = _one_line_exit(capsys, MODEL + _ds(tmp_path, train_batch_size=16,
                                             pipeline={"schedule": "flush"})
                         + ["--auto-plan", "--pipeline-schedule", "2bw"])
    assert "--pipeline-schedule 2bw conflicts with pipeline.schedule=flush" in err
    err = _one_line_exit(capsys, MODEL + ["--auto-plan"])
    assert "--auto-plan needs the global batch" in err and "train_batch_size" in err


def test_the_jsons_lr_scheduler_reaches_the_engine_not_the_config(tmp_path, world2):
    from megatron_2bw.config.ds_json import DeepSpeedLR
    ds = _ds(tmp_path, train_batch_size=8, scheduler={"type": "WarmupLR", "params": {
        "warmup_num_steps": 4, "warmup_max_lr": 0.01}})
    parsed = parse("gpt", MODEL + ds)
    assert isinstance(parsed.lr_schedule, DeepSpeedLR) and parsed.lr_schedule(0) == 0.0
    assert "ds_scheduler" not in parsed.cfg.to_dict()["optimizer"]
    assert parse("gpt", MODEL + ["--global-batch-size", "8"]).lr_schedule is None
