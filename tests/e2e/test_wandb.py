"""wandb (issue 47, build point 5): installed with the package, offline by default, its step the
iteration with every point of every log and evaluation at its own iteration (read back from the
offline run files), no key twice, Megatron's --wandb-* flags with Megatron's meanings, and a
--wandb-project whose wandb is missing or broken refused in one line before any process group."""
import glob
import importlib.abc
import importlib.machinery
import os
import re
import signal
import subprocess
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

import pytest

from megatron_2bw.training.observe.log_line import parse_line

ROOT = Path(__file__).resolve().parents[2]
FLAGS = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8"]


def test_offline_history_holds_every_point_at_its_iteration(tmp_path):
    pytest.importorskip("wandb")
    from megatron_2bw.testing.wandb_offline import read_history, read_run
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "RANK",
                                                                    "WORLD_SIZE", "LOCAL_RANK"))}
    # --log-interval 4 and --eval-interval 3 divide neither each other nor --train-iters 10:
    # the evaluations at 3 and 9 fall inside log intervals, the one at 6 too
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "pretrain_gpt.py"), *FLAGS, "--pipeline-model-parallel-size", "2",
           "--train-iters", "10", "--log-interval", "4", "--eval-interval", "3",
           "--eval-iters", "1", "--save", str(tmp_path / "ckpt"), "--wandb-project", "test",
           "--wandb-exp-name", "offline", "--wandb-entity", "my-team"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Tried to log to step" not in proc.stdout + proc.stderr, "wandb dropped points"
    runs = glob.glob(str(tmp_path / "ckpt" / "wandb" / "wandb" / "offline-run-*"))
    assert len(runs) == 1, "an offline run under {save}/wandb (offline without WANDB_MODE)"
    assert read_run(runs[0]) == {"project": "test", "entity": "my-team",
                                 "display_name": "offline", "run_group": ""}
    rows = read_history(runs[0])
    assert [row["_step"] for row in rows] == sorted({row["_step"] for row in rows}), \
        "one row per step, in order"
    at = defaultdict(list)
    for row in rows:
        for key in row:
            if not key.startswith("_"):
                at[key].append(row["_step"])
    assert at["lm loss"] == at["learning-rate"] == at["batch-size"] == list(range(1, 11))
    assert at["lm loss validation"] == at["lm loss validation ppl"] == [3, 6, 9]
    for key in ("grad-norm", "loss-scale", "iteration-time", "throughput", "samples/s",
                "tokens/s", "memory_GB_per_stage/stage1", "skipped-iterations"):
        assert at[key] == [4, 8, 10], key
    assert at["samples vs steps"] == list(range(1, 11)), "Megatron's wandb key, every row"
    names = {key.replace("-", " ").replace("_", " ") for key in at}
    assert len(names) == len(at), "no key twice under two spellings"
    assert not {"consumed-samples", "consumed_samples", "consumed samples"} & set(at)

    lines = proc.stdout.splitlines()
    logged = dict(filter(None, map(parse_line, lines)))
    loss = {row["_step"]: row["lm loss"] for row in rows if "lm loss" in row}
    for end, first in ((4, 1), (8, 5), (10, 9)):  # the line: the interval's mean
        mean = sum(loss[i] for i in range(first, end + 1)) / (end - first + 1)
        assert logged[end]["lm loss"] == pytest.approx(mean, rel=1e-5)
    valid = {row["_step"]: row["lm loss validation"] for row in rows
             if "lm loss validation" in row}
    for it in (3, 6, 9):
        assert logged[it]["lm loss value"] == pytest.approx(valid[it], rel=1e-5)


def test_wandb_is_a_core_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert any(re.match(r"wandb\b", d) for d in project["dependencies"])


class _Broken(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """An installed wandb whose import fails, as one built for another protobuf does."""

    def find_spec(self, name, path=None, target=None):
        if name == "wandb":
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise TypeError("Descriptors cannot be created directly.\nmore lines")


def _without_wandb(monkeypatch, broken: bool):
    """The import hook the test passes: wandb missing (None in sys.modules) or broken."""
    for name in [n for n in sys.modules if n == "wandb" or n.startswith("wandb.")]:
        monkeypatch.delitem(sys.modules, name)
    if broken:
        monkeypatch.setattr(sys, "meta_path", [_Broken(), *sys.meta_path])
    else:
        monkeypatch.setitem(sys.modules, "wandb", None)


@pytest.mark.parametrize("broken,says", [
    (False, "--wandb-project needs the wandb package, which is not installed: pip install "
            "wandb (megatron_2bw's install brings it), or drop --wandb-project"),
    (True, "--wandb-project needs the wandb package, which is installed but fails to import "
           "(TypeError: Descriptors cannot be created directly.): pip install "
           "--force-reinstall wandb, or drop --wandb-project")], ids=["missing", "broken"])
def test_wandb_project_without_a_working_wandb_is_one_line_before_any_process_group(
        monkeypatch, capsys, tmp_path, broken, says):
    from megatron_2bw import pretrain
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)

    def started(*args, **kwargs):
        raise AssertionError("a process group started")
    monkeypatch.setattr(pretrain, "start_process_group", started)
    usr1 = signal.getsignal(signal.SIGUSR1)
    _without_wandb(monkeypatch, broken)
    try:
        with pytest.raises(SystemExit) as exit_:
            pretrain.main("gpt", FLAGS + ["--train-iters", "2", "--wandb-project", "p",
                                          "--save", str(tmp_path / "ckpt"), "--tensorboard-dir",
                                          str(tmp_path / "tb")])
    finally:
        signal.signal(signal.SIGUSR1, usr1)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err == f"error: {says}\n"


def test_deepspeed_wandb_section_with_a_broken_wandb_is_one_line(monkeypatch):
    from megatron_2bw.config import ConfigError
    from megatron_2bw.config.ds_json.monitors import check_monitors
    _without_wandb(monkeypatch, broken=True)
    with pytest.raises(ConfigError, match=r"^DeepSpeed config: 'wandb' needs the wandb package, "
                                          r"which is installed but fails to import \(TypeError: "
                                          r"Descriptors cannot be created directly\.\): pip "
                                          r"install --force-reinstall wandb, or disable 'wandb'$"):
        check_monitors({"wandb": {"enabled": True}}, find_spec=lambda name: object())


def test_megatrons_wandb_flags_fill_the_config():
    from megatron_2bw.config.build import build_config
    from megatron_2bw.pretrain import build_parser
    args = build_parser("gpt").parse_args(FLAGS + [
        "--wandb-project", "p", "--wandb-exp-name", "e", "--wandb-entity", "team",
        "--wandb-save-dir", "/tmp/w", "--log-throughput"])
    t = build_config(args, "gpt", 1).config.train
    assert (t.wandb_project, t.wandb_exp_name, t.wandb_entity, t.wandb_save_dir,
            t.log_throughput) == ("p", "e", "team", "/tmp/w", True)
