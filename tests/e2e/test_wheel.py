"""The wheel as a user installs it (`pip install .`), used outside the checkout.

The wheel is built from a copy of the checkout's package files (pyproject.toml, setup.py,
README.md, LICENSE, megatron_2bw/) with `pip wheel --no-deps --no-build-isolation` (no network),
installed with --no-deps into a fresh venv under a temporary directory; the venv sees this
environment's third-party packages (torch, numpy, sentencepiece, tqdm: what the wheel depends
on, wandb included) through one .pth line, the way `--system-site-packages` would, so no torch is copied. From
another temporary directory, with PYTHONPATH unset, it runs through the venv's console scripts:
m2bw-train-tokenizer and m2bw-preprocess-data (a JSONL file), the README's main job on 2
processes (torchrun running m2bw-pretrain-gpt, a few iterations, --save), m2bw-plan and
m2bw-generate on the saved checkpoint; and checks that megatron_2bw was imported from the venv,
not from the checkout.
"""
import json
import os
import re
import shutil
import site
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "PYTHONPATH")
MAIN_JOB = ["--pipeline-model-parallel-size", "2", "--num-layers", "4", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "32", "--micro-batch-size", "4",
            "--global-batch-size", "32", "--lr", "3e-3", "--init-method-std", "0.1"]


def _run(argv, cwd, env, timeout=240):
    proc = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"{argv}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv bin directory, env) with the freshly built wheel installed."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "megatron_2bw", src / "megatron_2bw",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["WANDB_MODE"] = "offline"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
          "-w", tmp / "dist", src], cwd=tmp, env=env)
    (wheel,) = (tmp / "dist").glob("megatron_2bw-*.whl")
    venv.EnvBuilder(with_pip=False).create(tmp / "venv")
    py = tmp / "venv" / "bin" / "python"
    purelib = _run([py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                   cwd=tmp, env=env).strip()
    # this environment's third-party packages, after the venv's own (a .pth path line: its own
    # .pth files, e.g. the checkout's editable install, are not run)
    Path(purelib, "_deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _run([sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "-q", wheel],
         cwd=tmp, env=env)
    return tmp / "venv" / "bin", env


def test_the_wheel_installs_and_its_commands_run_outside_the_checkout(installed, tmp_path):
    bin_dir, env = installed
    work = tmp_path / "elsewhere"
    work.mkdir()
    where = json.loads(_run([bin_dir / "python", "-c", "import json, sys, megatron_2bw.cli; "
                             "print(json.dumps([megatron_2bw.cli.__file__, sys.path]))"],
                            cwd=work, env=env))
    assert where[0].startswith(str(bin_dir.parent)), where
    assert str(ROOT) not in where[1], where  # ("": the cwd, elsewhere)

    # the README's data commands through the console scripts
    docs = [{"text": f"The for statement number {i} iterates over the items of a sequence, "
                     f"in the order that they appear, and the while loop {i} repeats."}
            for i in range(200)]
    (work / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    _run([bin_dir / "m2bw-train-tokenizer", "--input", "corpus.jsonl", "--model-prefix", "tok",
          "--vocab-size", "320"], cwd=work, env=env)
    out = _run([bin_dir / "m2bw-preprocess-data", "--input", "corpus.jsonl",
                "--output-prefix", "corpus", "--tokenizer-model", "tok.model", "--append-eod"],
               cwd=work, env=env)
    assert (work / "corpus_text_document.bin").stat().st_size > 0, out

    # the main job: 2 processes, the embedded default corpus, a checkpoint for generate
    log = _run([bin_dir / "python", "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", "2", bin_dir / "m2bw-pretrain-gpt", *MAIN_JOB,
                "--train-iters", "4", "--log-interval", "2", "--save", "ckpt"], cwd=work,
               env=env)
    assert re.search(r"^ \[.*\] iteration +4/ +4 \|.*\| lm loss: [0-9.E+-]+ \|", log, re.M), \
        log[-2000:]
    assert (work / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"

    plan = json.loads(_run([bin_dir / "m2bw-plan", "--model", "debug", "--num-nodes", "1",
                            "--gpus-per-node", "4", "--gpu-memory-gb", "16",
                            "--global-batch-size", "32", "--json"], cwd=work, env=env))
    assert plan["chosen"]["schedule"] and "--pipeline-schedule" in plan["flags"], plan

    text = _run([bin_dir / "m2bw-generate", "--load", "ckpt", "--prompt", "The for statement",
                 "--max-new-tokens", "5"], cwd=work, env=env)
    assert "The for statement" in text, text
