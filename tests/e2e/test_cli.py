"""pretrain_gpt.py as a user runs it: bad input exits 2 with one line on stderr, before any
process group; the README main job trains."""
import atexit
import os
import re
import shlex
import shutil
import socket
import subprocess
import tempfile
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "pretrain_gpt.py"
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
               "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK")


def _env(world_size=None):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env["WANDB_MODE"] = "offline"
    if world_size is not None:   # simulate rank 0 of a torchrun launch
        env.update(RANK="0", WORLD_SIZE=str(world_size), LOCAL_RANK="0")
    return env


def run_script(args, world_size=None):
    """pretrain_gpt.py with its rendezvous port held here (listening, never accepting): a process
    group started before a check fails at once with EADDRINUSE, whatever the load (no timing)."""
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        env = dict(_env(world_size), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(held.getsockname()[1]))
        return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)  # bounds a hang


MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4"]

# (id, argv, WORLD_SIZE or None, key words the one stderr line must contain)
DS_DIR = Path(tempfile.mkdtemp(prefix="ds-json-"))
atexit.register(shutil.rmtree, DS_DIR, True)
(DS_DIR / "conflict.json").write_text('{"train_batch_size": 8, "gradient_clipping": 0.5}')
(DS_DIR / "triple.json").write_text('{"train_batch_size": 10, '
                                    '"train_micro_batch_size_per_gpu": 4, '
                                    '"gradient_accumulation_steps": 2}')
(DS_DIR / "broken.json").write_text('{"train_batch_size": ')
(DS_DIR / "zero.json").write_text('{"train_batch_size": 8, "zero_optimization": {"stage": 2}}')
(DS_DIR / "bad.idx").write_bytes(b"NOTMMIDX" + bytes(40))
(DS_DIR / "bad.bin").write_bytes(b"")
(DS_DIR / "bad.model").write_bytes(b"not a sentencepiece model")

BAD = [
    ("data-path-without-tokenizer", ["--data-path", "/nonexistent/corpus"], None,
     ["--data-path", "--tokenizer-model"]),
    ("data-idx-bad-header", ["--data-path", str(DS_DIR / "bad"), "--tokenizer-type",
                             "NullTokenizer", "--vocab-size", "100"], None, ["bad.idx"]),
    ("tokenizer-model-missing", ["--data-path", "/nonexistent/c", "--tokenizer-type",
                                 "GPTSentencePieceTokenizer",
                                 "--tokenizer-model", "/nonexistent/spm.model"], None,
     ["/nonexistent/spm.model"]),
    ("tokenizer-model-corrupt", ["--data-path", "/nonexistent/c", "--tokenizer-type",
                                 "GPTSentencePieceTokenizer",
                                 "--tokenizer-model", str(DS_DIR / "bad.model")], None,
     ["bad.model"]),
    ("ds-json-conflicts-with-flag", ["--mock-data", "--clip-grad", "1.0", "--deepspeed_config",
                                     str(DS_DIR / "conflict.json")], None,
     ["--clip-grad", "gradient_clipping"]),
    ("ds-json-batch-triple", ["--mock-data", "--deepspeed_config", str(DS_DIR / "triple.json")],
     None, ["train_batch_size"]),
    ("ds-json-not-json", ["--mock-data", "--deepspeed_config", str(DS_DIR / "broken.json")],
     None, ["broken.json"]),
    ("ds-json-missing", ["--mock-data", "--deepspeed_config", "/nonexistent/ds.json"], None,
     ["/nonexistent/ds.json"]),
    ("ds-json-zero-2-with-pipeline", ["--mock-data", "--deepspeed_config",
                                      str(DS_DIR / "zero.json")], None, ["zero"]),
    ("save-interval-without-save", ["--mock-data", "--save-interval", "10"], None,
     ["--save-interval", "--save"]),
    ("negative-keep-last", ["--mock-data", "--keep-last", "-1"], None, ["--keep-last"]),
    ("unknown-model-flavour", ["--mock-data", "--model", "gpt-9t"], None, ["--model"]),
    ("bert-flavour-in-gpt-script", ["--mock-data", "--model", "bert-base"], None,
     ["pretrain_bert.py"]),
    ("recompute-method-without-granularity", ["--mock-data", "--recompute-method", "uniform"],
     None, ["--recompute-granularity"]),
    ("vocab-not-divisible-by-tp", ["--mock-data", "--vocab-size", "511",
                                   "--tensor-model-parallel-size", "2"], 2, ["vocab"]),
    ("typo-flag-suggests", ["--mock-data", "--hiden-size", "64"], None,
     ["--hiden-size", "did you mean --hidden-size"]),
    ("typo-flag-with-equals", ["--mock-data", "--micro-batch-sise=4"], None,
     ["--micro-batch-sise", "--micro-batch-size"]),
    ("missing-data-file", ["--data-path", "/nonexistent/corpus", "--tokenizer-type",
                           "NullTokenizer", "--vocab-size", "100"], None, ["/nonexistent/corpus"]),
    ("zero-global-batch", ["--mock-data", "--global-batch-size", "0"], None,
     ["--global-batch-size"]),
    ("fp16-and-bf16", ["--mock-data", "--fp16", "--bf16"], None, ["--fp16", "--bf16"]),
    ("2bw-m-lt-d", ["--mock-data", *MODEL, "--pipeline-model-parallel-size", "4",
                    "--pipeline-schedule", "2bw", "--micro-batch-size", "1",
                    "--global-batch-size", "3"], 4, ["2bw", "--global-batch-size"]),
    ("2bw-m-lt-d-default-batch", ["--mock-data", *MODEL, "--pipeline-model-parallel-size", "4"],
     4, ["2bw", "--global-batch-size"]),
    ("world-not-multiple-of-pipeline", ["--mock-data", *MODEL,
                                        "--pipeline-model-parallel-size", "2"], 3,
     ["world size 3", "pipeline"]),
    ("world-ne-t*d*w", ["--mock-data", *MODEL, "--pipeline-model-parallel-size", "2",
                        "--data-parallel-size", "2", "--global-batch-size", "4"], 2,
     ["world size 2", "data"]),
    ("more-stages-than-layers", ["--mock-data", "--num-layers", "2",
                                 "--pipeline-model-parallel-size", "4",
                                 "--global-batch-size", "4"], 4,
     ["--pipeline-model-parallel-size", "--num-layers"]),
    ("global-batch-not-divisible", ["--mock-data", "--micro-batch-size", "4",
                                    "--global-batch-size", "6"], None,
     ["--global-batch-size", "--micro-batch-size"]),
    ("negative-ffn-hidden-size", ["--mock-data", "--ffn-hidden-size", "-5"], None,
     ["--ffn-hidden-size"]),
    ("unknown-schedule-choice", ["--mock-data", "--pipeline-schedule", "1f1b"], None,
     ["--pipeline-schedule", "1f1b"]),
    ("unknown-optimizer-choice", ["--mock-data", "--optimizer", "lamb"], None,
     ["--optimizer", "lamb"]),
    ("bad-int-value", ["--mock-data", "--num-layers", "four"], None, ["--num-layers", "four"]),
    ("missing-value", ["--mock-data", "--lr"], None, ["--lr"]),
    ("profile-end-not-after-start", ["--mock-data", "--profile", "--profile-step-start", "5",
                                     "--profile-step-end", "5"], None,
     ["--profile-step-start 5", "--profile-step-end 5", "start < end"]),
    ("profile-rank-outside-world", ["--mock-data", "--profile", "--profile-ranks", "0", "2"], 2,
     ["--profile-ranks 0 2", "0..1"]),
    ("straggler-threshold-zero", ["--mock-data", "--log-straggler", "--straggler-threshold",
                                  "0"], None, ["--straggler-threshold", "> 0"]),
    ("timers-to-tensorboard-without-dir", ["--mock-data", "--log-timers-to-tensorboard"], None,
     ["--log-timers-to-tensorboard", "--tensorboard-dir"]),
    ("tensorboard-dir-is-a-file", ["--mock-data", "--tensorboard-dir", "README.md"], None,
     ["--tensorboard-dir README.md is a file"]),
    ("tensorboard-queue-size-zero", ["--mock-data", "--tensorboard-dir", "/tmp/tb",
                                     "--tensorboard-queue-size", "0"], None,
     ["--tensorboard-queue-size"]),
]


def _one_line_exit_2(code, stdout, stderr, words):
    assert code == 2, (code, stdout, stderr)
    lines = stderr.splitlines()
    assert len(lines) == 1 and lines[0].strip(), f"stderr is not one line: {stderr!r}"
    for word in words:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"
    assert "Traceback" not in stderr
    from megatron_2bw.schedule.kinds import one_stage_note
    # the config's notes come before data checks; one stage's schedule line is one of them
    assert stdout.replace(one_stage_note(1) + "\n", "") == ""


@pytest.mark.parametrize("argv,world,words", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input_one_line_exit_2(argv, world, words, monkeypatch, capsys):
    """pretrain.main in this process (what pretrain_gpt.py runs): a process group started
    before the check fails the test at once."""
    from megatron_2bw import pretrain

    def no_group(*args, **kwargs):
        raise AssertionError("a process group was started before the check")
    monkeypatch.setattr(pretrain, "start_process_group", no_group)
    monkeypatch.setattr(pretrain, "watch_launcher", lambda: None)  # no launcher to watch here
    for key in LAUNCH_VARS:
        monkeypatch.delenv(key, raising=False)
    if world is not None:  # rank 0 of a torchrun launch
        for key, value in (("RANK", "0"), ("WORLD_SIZE", str(world)), ("LOCAL_RANK", "0")):
            monkeypatch.setenv(key, value)
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exit_:
        pretrain.main("gpt", [str(a) for a in argv])
    out = capsys.readouterr()
    _one_line_exit_2(exit_.value.code, out.out, out.err, words)


@pytest.mark.parametrize("case", ["bad-int-value", "world-ne-t*d*w", "data-path-without-tokenizer"])
def test_bad_input_is_one_line_and_exit_2_from_the_script(case):
    """The same through the process boundary: pretrain_gpt.py's exit status and its stderr, with
    its rendezvous port held (a process group started first would fail with EADDRINUSE)."""
    _, argv, world, words = next(c for c in BAD if c[0] == case)
    proc = run_script(argv, world)
    assert "EADDRINUSE" not in proc.stderr, "the check must run before any process group"
    _one_line_exit_2(proc.returncode, proc.stdout, proc.stderr, words)


# ---- the README main job ----------------------------------------------------------------------


def readme_main_job() -> list[str]:
    """The command of the first bash block under the '## Main job' heading, as argv."""
    text = (ROOT / "README.md").read_text()
    section = re.search(r"^## Main job.*?$(.*?)(?=^## )", text, re.S | re.M)
    assert section, "README.md has no '## Main job' section"
    block = re.search(r"```(?:bash|sh)?\n(.*?)```", section.group(1), re.S)
    assert block, "no code block in README.md's Main job section"
    return shlex.split(block.group(1).replace("\\\n", " "))


def test_readme_main_job_parses():
    argv = readme_main_job()
    assert argv[0] == "torchrun" and "pretrain_gpt.py" in argv and "--data-path" not in argv


LOSS = re.compile(r"^ \[[^\]]+\] iteration +(\d+)/ *\d+ \|.*\| lm loss: ([0-9.E+-]+) \|")


def test_readme_main_job_trains():
    argv = readme_main_job()
    assert argv[0] == "torchrun"
    launcher = ["torchrun"] if shutil.which("torchrun") else [sys.executable, "-m",
                                                              "torch.distributed.run"]
    cmd = launcher + argv[1:] + ["--train-iters", "30", "--log-interval", "5"]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=600)  # bounds a hang: two ranks train (and may build the corpus)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    logged = [(int(m.group(1)), float(m.group(2)))
              for m in map(LOSS.match, proc.stdout.splitlines()) if m]
    assert [it for it, _ in logged] == [5, 10, 15, 20, 25, 30], proc.stdout
    first, last = logged[0][1], logged[-1][1]
    assert first - last > 0.3, f"loss went from {first} to {last}:\n{proc.stdout}"
