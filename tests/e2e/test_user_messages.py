"""Messages about what the user typed (issue 48, point 6), each with the issue's case:

- --train-data-path / --valid-data-path / --test-data-path errors name those flags, never
  --data-path; a --valid-data-path that no evaluation reads (--eval-interval 0) is still opened
  and checked, as --test-data-path is;
- `checkpoint_convert.py to-dist` on a checkpoint that is torch_dist already says so;
- generate's out-of-range prompt id names the model's real vocabulary, and the fix it gives
  works when followed;
- a launcher mismatch (--local-rank against LOCAL_RANK, the launcher's --local-rank=N plus one
  typed after it, launcher variables that are no integers or a rank outside the world) is one
  line on every rank, before any process group, with no traceback of ours.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from inprocess import run_main  # noqa: E402  (tests/ is on the path: tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
               "TORCHELASTIC_RUN_ID", "GROUP_RANK")
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--train-iters", "2", "--no-memory-check"]
NULL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]


def parse_line(monkeypatch, capsys, argv, env=None) -> str:
    """pretrain_gpt.py's checks in this process: exit 2, one line on stderr (returned), and no
    process group."""
    import torch.distributed as dist
    from megatron_2bw.pretrain import parse
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    for var, value in (env or {}).items():
        monkeypatch.setenv(var, value)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        parse("gpt", [str(a) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    assert not dist.is_initialized()
    return err[0]


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    from megatron_2bw.data.preprocess import preprocess_jsonl
    d = tmp_path_factory.mktemp("per-split")
    rng = np.random.RandomState(0)
    (d / "c.jsonl").write_text("".join(
        json.dumps({"text": " ".join(map(str, rng.randint(0, 100, 40)))}) + "\n"
        for _ in range(30)))
    return preprocess_jsonl(str(d / "c.jsonl"), str(d / "c"), tokenizer_type="NullTokenizer",
                            vocab_size=100, append_eod=True, log_interval=0)["text"]


@pytest.mark.parametrize("flags,words", [
    (["--train-data-path", "0.5", "{p}", "0.5"],
     ["--train-data-path 0.5 ", "weights and prefixes must alternate",
      "e.g. --train-data-path 0.3 A 0.7 B"]),
    (["--train-data-path", "nan", "{p}"], ["--train-data-path: weights [nan] must be finite"]),
    (["--train-data-path", "{p}", "--valid-data-path", "0.5", "{p}", "0.5"],
     ["--valid-data-path 0.5 ", "e.g. --valid-data-path 0.3 A"]),
    (["--train-data-path", "{p}", "--test-data-path", "/no/such"],
     ["/no/such.idx: no such index file", "(--test-data-path /no/such)"]),
    (["--train-data-path", "/no/such"], ["(--train-data-path /no/such)"]),
    # never opened before: no evaluation asks for validation data, and the run "succeeded"
    (["--train-data-path", "{p}", "--valid-data-path", "/no/valid", "--eval-interval", "0"],
     ["/no/valid.idx: no such index file", "(--valid-data-path /no/valid)"]),
])
def test_per_split_errors_name_the_flag_typed(monkeypatch, capsys, prefix, flags, words):
    line = parse_line(monkeypatch, capsys, [*TINY, *NULL, *[f.format(p=prefix) for f in flags]])
    assert "--data-path" not in line, line  # (--train-data-path has no "--data-path" in it)
    for word in words:
        assert word in line, f"{word!r} not in {line!r}"


def test_the_valid_data_path_a_run_evaluates_is_taken(monkeypatch, capsys, prefix):
    from megatron_2bw.pretrain import parse
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    parsed = parse("gpt", [*TINY, *NULL, "--train-data-path", prefix, "--valid-data-path",
                           prefix, "--eval-interval", "0"])
    assert parsed.data.valid is None and len(parsed.data.train) >= 8


# ---- checkpoint_convert.py to-dist ---------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A 64-id llama-debug checkpoint in the torch format (iteration 0)."""
    from megatron_2bw.checkpoint.convert.native import FullModel, write_checkpoint
    from megatron_2bw.models.families import model_parts
    from megatron_2bw.testing.reference import build_sequential
    from megatron_2bw.testing.verify import parse
    d = tmp_path_factory.mktemp("ckpt") / "torch"
    cfg, _ = parse(["--model", "llama-debug", "--vocab-size", "64"])
    state = {n: p.detach() for n, p in build_sequential(cfg, model_parts(cfg)[0])
             .named_parameters()}
    return write_checkpoint(str(d), FullModel(cfg, state), 1, 1)


def test_to_dist_on_a_torch_dist_checkpoint_says_so(checkpoint, tmp_path):
    from megatron_2bw.checkpoint.convert.cli import main
    first = run_main(main, ["to-dist", "--load", checkpoint, "--save", tmp_path / "dist"])
    assert first.returncode == 0, first.stderr
    again = run_main(main, ["to-dist", "--load", tmp_path / "dist", "--save", tmp_path / "x"])
    assert again.returncode == 2 and again.stderr.strip() == (
        f"error: {tmp_path / 'dist'} iteration 0 is a torch_dist checkpoint already: nothing "
        f"to convert; resume from it with --load {tmp_path / 'dist'} and any parallel layout")
    assert "incomplete" not in again.stderr and not (tmp_path / "x").exists()


# ---- generate.py ---------------------------------------------------------------------------
def generate(*argv):
    from megatron_2bw.generate import main
    return run_main(main, ["--max-new-tokens", "2", *argv])


def test_an_out_of_range_prompt_id_names_the_models_vocabulary_and_the_fix_works(checkpoint):
    bad = generate("--load", checkpoint, "--prompt", "3 5000")
    assert bad.returncode == 2 and bad.stderr.strip() == (
        "error: prompt token id 5000 is outside the model's vocabulary, ids 0-63 (the 64 rows "
        "of its embedding): give ids below 64")
    assert generate("--load", checkpoint, "--prompt", "3 63").returncode == 0  # the fix
    # the old advice, "raise --vocab-size", followed: an IndexError in the embedding before
    big = generate("--load", checkpoint, "--prompt", "5000", "--tokenizer-type",
                   "NullTokenizer", "--vocab-size", "6000")
    assert big.returncode == 2 and "it is not the tokenizer the model was trained with; drop " \
        "--tokenizer-type/--tokenizer-model" in big.stderr and "IndexError" not in big.stderr
    text = generate("--load", checkpoint, "--prompt", "hello")
    assert text.returncode == 2 and "space-separated token ids" in text.stderr


def test_a_recorded_null_tokenizer_is_the_real_vocabulary(checkpoint, tmp_path):
    import shutil
    d = tmp_path / "ck"
    shutil.copytree(checkpoint, d)
    (d / "tokenizer_args.json").write_text(json.dumps({"tokenizer_type": "NullTokenizer",
                                                       "vocab_size": 40}))
    bad = generate("--load", d, "--prompt", "3 50")
    assert bad.returncode == 2 and bad.stderr.strip() == (
        "error: prompt token id 50 is outside the model's vocabulary, ids 0-40 (the "
        "NullTokenizer's 41 ids): give ids below 41")
    assert generate("--load", d, "--prompt", "3 40").returncode == 0


# ---- launcher mismatches ---------------------------------------------------------------------
@pytest.mark.parametrize("env,argv,words", [
    ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}, ["--local-rank", "1"],
     "--local-rank 1 disagrees with the launcher's local rank 0 (LOCAL_RANK)"),
    # torch.distributed.launch's own --local-rank=N, then one the user typed: every rank says so
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, ["--local-rank=0", "--local-rank", "0"],
     "--local-rank is given 2 times (--local-rank=0, --local-rank 0): the launcher"),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, ["--local-rank=1", "--local-rank", "0"],
     "--local-rank is given 2 times (--local-rank=1, --local-rank 0)"),
    ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "abc"}, [],
     "LOCAL_RANK='abc' is not an integer"),
    ({"RANK": "5", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, [],
     "RANK=5 WORLD_SIZE=2 LOCAL_RANK=0: the rank must be in 0..WORLD_SIZE-1"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, [], "RANK=-1 WORLD_SIZE=2"),
    ({"SLURM_PROCID": "x", "SLURM_NTASKS": "2"}, [], "SLURM_PROCID='x' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "r",
      "LOCAL_WORLD_SIZE": "two"}, [], "LOCAL_WORLD_SIZE='two' is not an integer"),
])
def test_launcher_mismatches_are_one_line(monkeypatch, capsys, env, argv, words):
    line = parse_line(monkeypatch, capsys, ["--mock-data", *TINY, *argv], env)
    assert words in line, line


def test_torch_distributed_launch_with_a_typed_local_rank_stops_every_rank_in_one_line():
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(PYTHONPATH=str(ROOT), WANDB_MODE="offline")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.launch", "--standalone", "--nproc_per_node",
         "2", str(ROOT / "pretrain_gpt.py"), "--mock-data", *TINY, "--local-rank", "0"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    ours = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(ours) == 2 and all("--local-rank is given 2 times" in ln for ln in ours), \
        proc.stderr
    # torch's launcher then reports the failed children with its own ChildFailedError
    # traceback; none comes from our processes, and no rank started training
    tb = proc.stderr.find("Traceback")
    assert tb == -1 or ("ChildFailedError" in proc.stderr[tb:]
                        and "megatron_2bw" not in proc.stderr[tb:]), proc.stderr
    assert "iteration" not in proc.stdout
