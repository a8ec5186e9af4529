"""examples/deepspeed_style/cifar_pipeline.py, a script in the shape of DeepSpeedExamples'
training/pipeline_parallelism/train.py (`from deepspeed.x import y` imports, set_random_seed,
initialize(args=..., training_data=...), train_batch() without an iterator), run as commands:
under torchrun and under DeepSpeed's `deepspeed` launcher on megatron_2bw, and (slow) under the
real DeepSpeed with its one import line changed back, flush losses equal to 1e-5 in fp32.

The real DeepSpeed runs with a test-only sitecustomize on PYTHONPATH that skips its JIT build of
a CPU shared-memory all-reduce (minutes of C++; gloo carries the same collectives)."""
import difflib
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_deepspeed_examples import AFTER

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "deepspeed_style" / "cifar_pipeline.py"
OURS = "import megatron_2bw.deepspeed.alias as deepspeed"
CONFIG = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
          "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.9, 0.999],
                                                   "eps": 1e-8}},
          "steps_per_print": 100, "wall_clock_breakdown": False,
          "pipeline": {"schedule": "flush"}}
SKIP_SHM = AFTER + '\n_after("deepspeed.comm.torch", _no_shm)\n'


def _prepare(tmp: Path, real: bool) -> Path:
    text = SCRIPT.read_text()
    if real:
        text = re.sub(rf"^{re.escape(OURS)}.*$", "import deepspeed", text, flags=re.M)
        changed = [d for d in difflib.ndiff(SCRIPT.read_text().splitlines(), text.splitlines())
                   if d.startswith(("+ ", "- "))]
        assert len(changed) == 2, changed        # exactly the one import line
    script = tmp / ("real.py" if real else "ours.py")
    script.write_text(text)
    (tmp / "ds.json").write_text(json.dumps(CONFIG))
    (tmp / "site").mkdir(exist_ok=True)
    (tmp / "site" / "sitecustomize.py").write_text(SKIP_SHM)
    return script


def _run(cmd, tmp: Path, timeout: int) -> list[float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_RANK",
                                                                      "WORLD_SIZE", "MASTER_"))}
    env.update(DS_ACCELERATOR="cpu", PYTHONPATH=f"{tmp / 'site'}{os.pathsep}{ROOT}",
               OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = [float(m) for m in re.findall(r"^step: \d+ loss: (\S+)$", proc.stdout, re.M)]
    assert len(losses) == 4, proc.stdout[-3000:]
    return losses


def _args(script: Path) -> list[str]:
    return [str(script), "--backend", "gloo", "--deepspeed_config", "ds.json", "-p", "2",
            "--steps", "4"]


def _torchrun(script: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            "2", *_args(script)]


def _deepspeed_launcher() -> str | None:
    found = Path(sys.executable).parent / "deepspeed"
    return str(found) if found.exists() else shutil.which("deepspeed")


def test_script_runs_under_torchrun_and_the_deepspeed_launcher(tmp_path):
    launcher = _deepspeed_launcher()
    if launcher is None or importlib.util.find_spec("deepspeed") is None:
        pytest.skip("DeepSpeed's `deepspeed` launcher is not installed")
    script = _prepare(tmp_path, real=False)
    by_torchrun = _run(_torchrun(script), tmp_path, 240)
    with socket.socket() as s:         # a free port for the launcher's rendezvous
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    by_launcher = _run([launcher, "--num_gpus", "2", "--master_port", port, *_args(script)],
                       tmp_path, 240)
    assert by_launcher == by_torchrun       # the same run, whoever starts it
    assert all(2.0 < x < 2.6 for x in by_torchrun)   # cross-entropy over 10 classes


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="deepspeed is not installed")
def test_flush_reproduces_real_deepspeeds_losses(tmp_path):
    ours = _run(_torchrun(_prepare(tmp_path, real=False)), tmp_path, 240)
    real = _run(_torchrun(_prepare(tmp_path, real=True)), tmp_path, 540)
    assert ours == pytest.approx(real, rel=1e-5, abs=1e-5)
