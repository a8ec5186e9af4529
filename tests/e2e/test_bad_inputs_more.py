"""More of the same kind (issue 48): values and files each console script used before checking
them, found by trying bad input on every script of pyproject.toml's [project.scripts]. Each is
now one line and exit 2 before anything runs (plot_schedule: exit 1, its convention), and where
a peer accepts the value (Megatron, DeepSpeed, torch) it is accepted here too.

Before: --init-method-std -1, --adam-eps -1 and --lr-decay-iters 0 reached the model or the
optimizer (or were taken as "unset"); --min-lr above --lr, --loss-scale-window 0, --hysteresis 0
and a --min-loss-scale above --initial-loss-scale are Megatron assertions; fp16.initial_scale_power
2000 was an OverflowError; train_tokenizer.py blamed the vocabulary size for sentencepiece's
other ranges; plan.py --profile-out into a file's path failed after the measuring; plot_schedule
--durations F=x / F=nan, --model NAME and a bad --profile were tracebacks; gpu_check --dry-run
took --gpus 0 and --mfu-floor 2; generate --iteration N of a directory without it blamed an
"incomplete checkpoint"; argparse errors of the plain tools printed their usage (many lines).
"""
from __future__ import annotations

import json
import sys

import pytest

from inprocess import run_main  # noqa: E402  (tests/ is on the path: tests/conftest.py)

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS")
TINY = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--train-iters", "2", "--no-memory-check"]


def pretrain(monkeypatch, argv):
    """pretrain_gpt.py's checks in this process: (exit code, stderr); exit 0 means the checks
    passed (nothing trains: parse only)."""
    from megatron_2bw.pretrain import parse
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    return run_main(lambda a: parse("gpt", a) and 0, [*TINY, *argv])


def one_line(proc, words, code=2):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code and len(lines) == 1, proc.stderr
    assert words in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("argv,words", [
    (["--init-method-std", "-1"], "--init-method-std must be >= 0, got -1.0"),
    (["--adam-eps", "-1"], "--adam-eps must be >= 0, got -1.0"),
    (["--optimizer", "sgd", "--sgd-momentum", "-0.5"], "--sgd-momentum must be >= 0"),
    (["--lr-decay-iters", "0"], "--lr-decay-iters must be >= 1 (or unset: --train-iters)"),
    (["--min-lr", "1", "--lr", "0.1"], "--min-lr 1 is above --lr 0.1: lower it or raise --lr"),
    (["--lr-warmup-init", "0.5", "--lr", "0.1"], "--lr-warmup-init 0.5 is above --lr 0.1"),
    (["--fp16", "--loss-scale-window", "0"], "--loss-scale-window must be >= 1, got 0"),
    (["--fp16", "--hysteresis", "0"], "--hysteresis must be >= 1, got 0"),
    (["--fp16", "--min-loss-scale", "1e10"],
     "--min-loss-scale 1e+10 is above --initial-loss-scale 4.29497e+09"),
])
def test_values_megatron_or_torch_refuse_are_one_line(monkeypatch, argv, words):
    one_line(pretrain(monkeypatch, argv), words)


@pytest.mark.parametrize("argv", [["--adam-eps", "0"], ["--optimizer", "sgd", "--sgd-momentum",
                                                        "2"], ["--init-method-std", "0"],
                                  ["--fp16", "--loss-scale", "8", "--hysteresis", "0"]])
def test_what_torch_and_megatron_accept_is_accepted(monkeypatch, argv):
    proc = pretrain(monkeypatch, argv)
    assert proc.returncode == 0, proc.stderr


def test_a_deepspeed_scheduler_may_warm_up_downwards(monkeypatch, tmp_path):
    """DeepSpeed's WarmupLR runs from warmup_min_lr to warmup_max_lr whichever is larger (the
    Megatron rule --min-lr <= --lr is its scheduler's); an initial_scale_power whose 2^p is no
    float is refused by name."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 4, "scheduler": {"type": "WarmupLR", "params":
                                {"warmup_min_lr": 0.1, "warmup_max_lr": 0.01}}}))
    assert pretrain(monkeypatch, ["--deepspeed_config", str(path)]).returncode == 0
    path.write_text(json.dumps({"train_batch_size": 4, "fp16": {"enabled": True,
                                                                "initial_scale_power": 2000}}))
    one_line(pretrain(monkeypatch, ["--deepspeed_config", str(path)]),
             "fp16.initial_scale_power 2000: the loss scale 2^2000 is no float; use at most "
             "1023")
    path.write_text(json.dumps({"train_batch_size": 4, "fp16": {"enabled": True,
                                                                "initial_scale_power": 1023}}))
    assert pretrain(monkeypatch, ["--deepspeed_config", str(path)]).returncode == 0


def tool(name, argv):
    import importlib
    module = importlib.import_module(name)
    return run_main(module.main, argv)


@pytest.mark.parametrize("argv,words", [
    (["--vocab-size", "0"], "--vocab-size 0: must be >= 1"),
    (["--character-coverage", "0.5"], "--character-coverage 0.5: must be in [0.98, 1]"),
    (["--workers", "0"], "--workers 0: must be in 1..1024"),
    (["--model-prefix", "{d}/afile/m"], "is not a directory: create it"),
])
def test_train_tokenizer_checks_sentencepieces_ranges_first(tmp_path, argv, words):
    (tmp_path / "in.txt").write_text("hello world\n")
    (tmp_path / "afile").write_text("x")
    argv = ["--input", tmp_path / "in.txt", "--model-prefix", tmp_path / "m",
            *[str(a).format(d=tmp_path) for a in argv]]
    one_line(tool("megatron_2bw.cli.train_tokenizer", argv), words)
    assert not (tmp_path / "m.model").exists()


def test_plan_checks_profile_out_before_measuring(tmp_path, monkeypatch):
    import megatron_2bw.planner.cli as cli
    monkeypatch.setattr(cli, "measure_profile", lambda *a, **k: pytest.fail("measured"))
    (tmp_path / "afile").write_text("x")
    one_line(tool("megatron_2bw.planner.cli", ["--model", "debug", "--profile-out",
                                               tmp_path / "afile" / "x.json"]),
             "--profile-out (its directory)")
    one_line(tool("megatron_2bw.planner.cli", ["--model", "debug", "--profile-out", tmp_path]),
             "is a directory: name a file")


def plot(argv):
    from megatron_2bw.cli.plot_schedule import main

    def as_python_runs_it(a):  # SystemExit("line"): Python prints the line, exit code 1
        try:
            return main(a)
        except SystemExit as e:
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
            raise
    return run_main(as_python_runs_it, argv)


@pytest.mark.parametrize("argv,words,code", [
    (["--durations", "F=x"], "--durations: bad entry 'F=x'", 1),
    (["--durations", "F=nan"], "(finite durations >= 0)", 1),
    (["--durations", "B=-1"], "(finite durations >= 0)", 1),
    (["--model", "nope"], "unknown model 'nope'", 1),
    (["--model", "gpt-125m", "--profile", "{d}/bad.json"], "bad.json: not valid JSON", 1),
    (["--window", "1:nan"], "--window takes START:END, two finite numbers", 2),
    (["-d", "0"], "-d, -m and --batches must be >= 1", 2),
])
def test_plot_schedule_bad_values_are_one_line(tmp_path, argv, words, code):
    (tmp_path / "bad.json").write_text("{nope")
    proc = plot([*[a.format(d=tmp_path) for a in argv], "--out", str(tmp_path / "x.png")])
    one_line(proc, words, code)
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("argv,words", [
    (["--gpus", "0"], "--gpus 0: must be >= 1"),
    (["--peak-tflops", "-1"], "--peak-tflops -1.0: must be > 0"),
    (["--mfu-floor", "2"], "--mfu-floor 2.0: must be in [0, 1]"),
    (["--micro-batch-size", "0"], "--micro-batch-size 0: must be >= 1"),
])
def test_gpu_check_refuses_values_before_the_plan(argv, words):
    one_line(tool("megatron_2bw.testing.gpu_check", ["--dry-run", *argv]), words)


def test_generate_names_the_iterations_a_directory_holds(tmp_path):
    from megatron_2bw.checkpoint.convert.native import FullModel, write_checkpoint
    from megatron_2bw.models.families import model_parts
    from megatron_2bw.testing.reference import build_sequential
    from megatron_2bw.testing.verify import parse
    cfg, _ = parse(["--vocab-size", "64"])
    state = {n: p.detach() for n, p in build_sequential(cfg, model_parts(cfg)[0])
             .named_parameters()}
    write_checkpoint(str(tmp_path / "ck"), FullModel(cfg, state), 1, 1)
    one_line(tool("megatron_2bw.generate", ["--load", tmp_path / "ck", "--iteration", "7"]),
             "holds no iteration 7 (it holds 0): give one of them to --iteration")
    (tmp_path / "empty").mkdir()
    one_line(tool("megatron_2bw.generate", ["--load", tmp_path / "empty", "--iteration", "3"]),
             "holds no checkpoint (no iter_* directory)")


@pytest.mark.parametrize("module,argv", [
    ("megatron_2bw.cli.train_tokenizer", ["--vocab-size", "x"]),
    ("megatron_2bw.cli.preprocess_data", ["--workers", "x"]),
    ("megatron_2bw.checkpoint.inspect", []),
    ("megatron_2bw.planner.cli", ["--num-gpus", "x"]),
])
def test_argparse_errors_of_every_tool_are_one_line(module, argv):
    proc = tool(module, argv)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and ": error: " in lines[0], proc.stderr


@pytest.mark.parametrize("value", ["abc", "nan", "0", "-5"])
def test_deepspeed_timeout_variable_is_checked_before_the_process_group(monkeypatch, value):
    import torch.distributed as dist
    from megatron_2bw.config import ConfigError
    from megatron_2bw.deepspeed.initialize import init_distributed
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("DEEPSPEED_TIMEOUT", value)
    with pytest.raises(ConfigError) as e:
        init_distributed()
    assert str(e.value).startswith(f"DEEPSPEED_TIMEOUT={value!r}: the process group timeout")
    assert not dist.is_initialized()


def test_nan_in_a_config_dict_given_to_deepspeed_initialize(monkeypatch):
    """A Python dict is typed as a JSON file is: float('nan') where a number is meant."""
    import math

    import torch.distributed as dist
    from torch import nn

    import megatron_2bw as deepspeed
    from megatron_2bw.config import ConfigError
    from megatron_2bw.deepspeed.pipe import LayerSpec, PipelineModule
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    net = PipelineModule([LayerSpec(nn.Linear, 4, 4), LayerSpec(nn.Linear, 4, 2)], num_stages=1)
    with pytest.raises(ConfigError) as e:
        deepspeed.initialize(model=net, config={"train_batch_size": 2, "gradient_clipping":
                                                math.nan, "optimizer": {"type": "AdamW",
                                                "params": {"lr": math.inf}}})
    assert str(e.value) == ("DeepSpeed config: gradient_clipping must be a finite number, got "
                            "NaN; optimizer.params.lr must be a finite number, got Infinity")
    assert not dist.is_initialized()


@pytest.mark.parametrize("content,words", [
    (None, "no such file"), (b"\x00\x01\x02garbage", "binary data, not text"),
    (b"a,b\n1,2\n", "not a losses.csv"), (b"iteration,gpipe\n1,x\n", "no number"),
    (b"iteration,gpipe\n1,nan\n", "not finite"),
    (b"iteration,nope\n1,2.5\n", "a column: 'nope' names no schedule")])
def test_compare_convergence_from_csv_reads_its_file_first(tmp_path, content, words):
    path = tmp_path / "losses.csv"
    if content is not None:
        path.write_bytes(content)
    proc = tool("megatron_2bw.cli.compare_convergence", ["--from-csv", path, "--out-dir",
                                                          tmp_path / "out"])
    line = one_line(proc, words)
    assert str(path) in line and not (tmp_path / "out" / "convergence.png").exists()


@pytest.mark.parametrize("argv,words", [(["--nproc", "0"], "--nproc must be >= 1, got 0"),
                                        (["--train-iters", "0"], "--train-iters must be >= 1")])
def test_compare_convergence_counts(tmp_path, argv, words):
    one_line(tool("megatron_2bw.cli.compare_convergence", [*argv, "--out-dir", tmp_path]), words)


@pytest.mark.parametrize("argv,words", [(["--rtol", "-1"], "--rtol must be >= 0"),
                                        (["--timeout-minutes", "0"],
                                         "--timeout-minutes must be > 0, got 0.0")])
def test_verify_equivalence_tolerance_and_timeout(argv, words):
    one_line(tool("megatron_2bw.testing.verify", argv), words)
