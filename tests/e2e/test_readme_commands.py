"""The README's data commands as a user types them: train a tokenizer, preprocess, train on it.

The three commands of the `## Data` block run exactly as written in a fresh directory that holds
`corpus.jsonl` (the embedded corpus, one JSON object per topic) and links to `tools/` and
`pretrain_gpt.py`; only the interpreter is resolved (`python` is this Python, `torchrun` is
`python -m torch.distributed.run` when not on PATH). The training command runs a few iterations
in the default suite and as written (200 iterations) in the slow one.
"""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_2bw.data.default_corpus import corpus_documents
from megatron_2bw.data.indexed_dataset import MMapIndexedDataset
from megatron_2bw.data.tokenizer import GPTSentencePieceTokenizer

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
LOSS = re.compile(r"^ \[[^\]]+\] iteration +(\d+)/ *\d+ \|.*\| lm loss: ([0-9.E+-]+) \|")


def readme_blocks(heading: str) -> list[list[list[str]]]:
    """The commands (as argv) of each bash block under '## {heading}'."""
    text = (ROOT / "README.md").read_text()
    section = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## )", text, re.S | re.M)
    assert section, f"README.md has no '## {heading}' section"
    blocks = re.findall(r"```bash\n(.*?)```", section.group(1), re.S)
    assert blocks, f"no bash block in README.md's {heading} section"
    return [[shlex.split(line) for line in block.replace("\\\n", " ").splitlines()
             if line.strip()] for block in blocks]


def readme_block(heading: str) -> list[list[str]]:
    """The commands (as argv) of the first bash block under '## {heading}'."""
    return readme_blocks(heading)[0]


def resolve(argv: list[str]) -> list[str]:
    if argv[0] == "python":
        return [sys.executable, *argv[1:]]
    if argv[0] == "torchrun":
        launcher = [shutil.which("torchrun")] if shutil.which("torchrun") else \
            [sys.executable, "-m", "torch.distributed.run"]
        return launcher + argv[1:]
    if argv[0] == "tensorboard":
        return [sys.executable, "-m", "tensorboard.main", *argv[1:]]
    raise AssertionError(f"unexpected command in the README: {argv[0]}")


def env() -> dict:
    e = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    e["WANDB_MODE"] = "offline"
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return e


def run(argv, cwd, timeout):
    proc = subprocess.run(resolve(argv), cwd=cwd, env=env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{shlex.join(argv)}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A user's directory after the README's tokenizer and preprocessing commands."""
    work = tmp_path_factory.mktemp("readme")
    with open(work / "corpus.jsonl", "w") as f:
        for doc in corpus_documents():
            f.write(json.dumps({"text": doc}) + "\n")
    (work / "tools").symlink_to(ROOT / "tools")
    (work / "pretrain_gpt.py").symlink_to(ROOT / "pretrain_gpt.py")
    commands = readme_block("Data")
    assert [c[:2] for c in commands[:2]] == [["python", "tools/train_tokenizer.py"],
                                             ["python", "tools/preprocess_data.py"]]
    assert commands[2][0] == "torchrun" and "pretrain_gpt.py" in commands[2]
    for argv in commands[:2]:
        run(argv, work, timeout=120)
    return work, commands


def test_readme_tokenizer_and_preprocess_commands_run_as_written(prepared):
    work, commands = prepared
    model = work / "my_spm.model"
    tokenizer = GPTSentencePieceTokenizer(str(model))
    assert tokenizer.vocab_size == int(commands[0][commands[0].index("--vocab-size") + 1])
    data = MMapIndexedDataset(str(work / "my_corpus_text_document"))
    assert len(data) == len(corpus_documents())
    tokens = data.tokens()
    assert tokens.max() < tokenizer.vocab_size
    assert np.count_nonzero(tokens == tokenizer.eod) == len(data)  # --append-eod
    assert not [name for name in os.listdir(work) if ".tmp-" in name]  # nothing left over


def test_readme_training_command_trains_on_the_preprocessed_data(prepared):
    work, commands = prepared
    argv = commands[2] + ["--train-iters", "6", "--log-interval", "3"]
    proc = run(argv, work, timeout=180)
    logged = [int(m.group(1)) for m in map(LOSS.match, proc.stdout.splitlines()) if m]
    assert logged == [3, 6], proc.stdout
    assert "vocab 8064" in proc.stdout  # 8000 pieces padded to a multiple of 128


@pytest.mark.slow
def test_readme_training_command_as_written(prepared):
    work, commands = prepared
    proc = run(commands[2], work, timeout=600)
    losses = [float(m.group(2)) for m in map(LOSS.match, proc.stdout.splitlines()) if m]
    assert len(losses) == 10, proc.stdout
    assert losses[0] - losses[-1] > 0.5, losses  # about 6.85 (iterations 1-20) -> 5.97


WATCHING = "Watching a run: TensorBoard, profiles, stragglers, non-finite values"


def test_readme_tensorboard_recipe_writes_what_tensorboard_reads(tmp_path):
    """The recipe's run (shortened), then its `tensorboard --logdir` asked to --inspect the
    events it would serve."""
    pytest.importorskip("tensorboard")
    (train, board), _ = readme_blocks(WATCHING)
    assert train[0] == "torchrun" and board[:2] == ["tensorboard", "--logdir"]
    assert train[train.index("--tensorboard-dir") + 1] == board[2]
    (tmp_path / "pretrain_gpt.py").symlink_to(ROOT / "pretrain_gpt.py")
    run(train + ["--train-iters", "4", "--log-interval", "2", "--eval-interval", "2"], tmp_path,
        timeout=180)
    shown = run(board + ["--inspect"], tmp_path, timeout=120).stdout
    for tag in ("lm loss", "learning-rate", "grad-norm", "lm loss vs samples", "iteration-time",
                "memory_GB_per_stage/stage1", "lm loss validation", "lm loss validation ppl",
                "ms_forward"):
        assert re.search(rf"^\s+{re.escape(tag)}$", shown, re.M), (tag, shown)


def test_readme_profile_recipe_names_the_files_it_writes():
    from megatron_2bw.config.build import build_config
    from megatron_2bw.pretrain import build_parser
    from megatron_2bw.training.observe.profiling import profile_path
    _, (profile,) = readme_blocks(WATCHING)
    assert profile[0] == "torchrun" and profile[4] == "pretrain_gpt.py"
    cfg = build_config(build_parser("gpt").parse_args(profile[5:]), "gpt", 2).config
    t = cfg.train
    assert t.profile and t.profile_ranks == (0, 1)
    readme = (ROOT / "README.md").read_text()
    first = t.profile_step_start + 1
    assert f"`{profile_path(t, 0, first, t.profile_step_end)}`" in readme
    assert f"iterations {first}-{t.profile_step_end} on" in readme


@pytest.mark.slow
def test_readme_profile_recipe_writes_a_trace_per_rank(tmp_path):
    from megatron_2bw.config.build import build_config
    from megatron_2bw.pretrain import build_parser
    from megatron_2bw.training.observe.profiling import profile_path
    _, (profile,) = readme_blocks(WATCHING)
    (tmp_path / "pretrain_gpt.py").symlink_to(ROOT / "pretrain_gpt.py")
    t = build_config(build_parser("gpt").parse_args(profile[5:]), "gpt", 2).config.train
    run(profile + ["--train-iters", str(t.profile_step_end)], tmp_path, timeout=300)
    for rank in t.profile_ranks:
        trace = json.loads((tmp_path / profile_path(t, rank, t.profile_step_start + 1,
                                                    t.profile_step_end)).read_text())
        names = {e["name"] for e in trace["traceEvents"] if e.get("cat") == "user_annotation"}
        assert {"S10", "S11"} <= names, sorted(names)[:40]
