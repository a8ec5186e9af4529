"""Nothing is written before everything is checked (issue 48 point 1): a run refused after its
flags parse leaves --load and --save byte-identical (every file's sha256, and the same files).

The checkpoint X is a real run's: pretrain_gpt.py trained with GPT2BPETokenizer at hidden size
32 (2 iterations, --save X), which recorded its tokenizer with its save. Before each check X also
holds the leftover of a killed writer (`.tmp-iter_0000009/`, `with_leftover`): the start-up removed it
before the model, layout and data checks ran, so every refusal below changed X before this
change. Each refusal is a run of pretrain with
--load X --save X and one thing wrong, in process (pretrain.parse: the checks every rank makes
before any process group), exit 2 and one line; the issue's data-loss case runs as the user
typed it, and tools/generate.py --load X still samples with X's tokenizer after it.
"""
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from inprocess import run_main
from megatron_2bw.data.default_corpus import corpus_documents
from megatron_2bw.data.preprocess import preprocess_jsonl
from megatron_2bw.data.tokenizer import train_sentencepiece
from megatron_2bw.pretrain import parse
from test_megatron_scripts import gpt2_files

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4"]


def digests(root) -> dict:
    """{relative path: sha256} of every file under `root`."""
    out = {}
    for where, _, names in os.walk(root):
        for name in names:
            path = os.path.join(where, name)
            out[os.path.relpath(path, root)] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return out


def with_leftover(x: Path) -> dict:
    """X's digests, with a killed writer's leftover in it (put back if a test before removed
    it)."""
    leftover = x / ".tmp-iter_0000009"
    if not leftover.exists():
        leftover.mkdir()
        (leftover / "__0_0.distcp").write_bytes(b"a killed writer's")
    return digests(x)


def _run(argv, cwd):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(WANDB_MODE="offline", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), *map(str, argv)],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(work directory, X, the flags that resume X as it was trained)."""
    d = tmp_path_factory.mktemp("refused")
    vocab, merges = gpt2_files(d)
    gpt2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges]
    docs = corpus_documents()[:20]
    (d / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    options = {"vocab_file": str(vocab), "merge_file": str(merges)}
    preprocess_jsonl(str(d / "corpus.jsonl"), str(d / "gpt2"), tokenizer_type="GPT2BPETokenizer",
                     append_eod=True, log_interval=0, tokenizer_options=options)
    (d / "ids.jsonl").write_text("".join(json.dumps({"text": f"{i} 999 {i}"}) + "\n"
                                         for i in range(40)))
    preprocess_jsonl(str(d / "ids.jsonl"), str(d / "ids1000"), tokenizer_type="NullTokenizer",
                     vocab_size=1000, append_eod=True, log_interval=0)
    train_sentencepiece(["hello world", "foo bar baz"] * 50, str(d / "sp.model"), 300, "bpe",
                        hard_vocab_limit=False)
    x = d / "X"
    flags = [*gpt2, "--data-path", d / "gpt2_text_document", *MODEL]
    proc = _run([*flags, "--train-iters", "2", "--save", x], d)
    assert proc.returncode == 0, proc.stderr[-3000:]
    recorded = json.loads((x / "tokenizer_args.json").read_text())
    assert recorded["tokenizer_type"] == "GPT2BPETokenizer"
    return d, x, [str(a) for a in [*flags, "--train-iters", "4", "--load", x, "--save", x]]


def _refused(argv) -> str:
    proc = run_main(lambda a: parse("gpt", a) and 0, argv)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    return lines[0]


def test_the_issues_data_loss_case_leaves_x_byte_identical_and_generate_works(trained):
    d, x, _ = trained
    before = with_leftover(x)
    proc = _run(["--data-path", d / "gpt2_text_document", *MODEL, "--train-iters", "4",
                 "--hidden-size", "64", "--load", "X", "--save", "X",
                 "--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", "sp.model"],
                d)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "saved for another model (hidden_size 32 != 64" in lines[0], \
        proc.stderr
    assert digests(x) == before
    assert not (x / "tokenizer.model").exists()
    from megatron_2bw.generate import main as generate
    out = run_main(generate, ["--load", x, "--prompt", "hello", "--max-new-tokens", "3"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("hello") and len(out.stdout.strip()) > len("hello")


# (what is wrong, the flags added to the resume of X (a flag given "" is dropped), words of the
# one line)
REFUSALS = [
    ("model", ["--hidden-size", "64"], "saved for another model (hidden_size 32 != 64"),
    ("model flag", ["--apply-layernorm-1p"], "apply_layernorm_1p False != True"),
    ("data position", ["--global-batch-size", "8"], "would resume from other samples"),
    ("save directory", ["--load", ""], "already holds iteration 2, newer than"),
    ("tokenizer", ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model",
                   "{d}/vocab.json"], "not a sentencepiece model"),
    ("tokenizer file", ["--merge-file", "{d}/no-merges.txt"], "no-merges.txt"),
    ("data", ["--data-path", "{d}/ids1000_text_document"], "token ids go up to 1000"),
    ("validation data", ["--data-path", "", "--train-data-path", "{d}/gpt2_text_document",
                         "--valid-data-path", "{d}/nowhere"], "--valid-data-path"),
    ("empty validation", ["--skip-train", "--split", "100,0,0"], "--skip-train evaluates"),
]


def _resume(flags: list, extra: list) -> list:
    """X's resume flags with `extra` added, a flag given "" dropped."""
    dropped = {extra[i] for i in range(len(extra) - 1) if extra[i + 1] == ""}
    out, i = [], 0
    for argv in (flags, extra):
        i = 0
        while i < len(argv):
            if argv[i] in dropped:
                i += 2
                continue
            out.append(argv[i])
            i += 1
    return out


@pytest.mark.parametrize("argv,words", [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_every_refusal_after_parse_leaves_load_and_save_byte_identical(trained, argv, words):
    d, x, flags = trained
    before = with_leftover(x)
    assert words in _refused(_resume(flags, [a.format(d=d) for a in argv]))
    assert digests(x) == before


def test_a_refusal_for_memory_leaves_them_byte_identical(trained, monkeypatch):
    from megatron_2bw.planner import memory_check
    _, x, flags = trained
    monkeypatch.setattr(memory_check, "host_available_bytes", lambda: 1 << 10)
    before = with_leftover(x)
    assert "host memory has 0.0 GB free" in _refused(flags)
    assert digests(x) == before


def test_checks_that_pass_write_nothing_and_hand_the_tokenizer_to_the_save(trained):
    """parse takes the tokenizer's record without writing it (the run's saves publish it:
    tests/unit/test_checkpoint_rules.py); the leftover stays until every rank has started."""
    _, x, flags = trained
    before = with_leftover(x)
    parsed = run_main(lambda a: parse("gpt", a) and 0, flags)
    assert parsed.returncode == 0, parsed.stderr
    assert digests(x) == before
    assert (x / ".tmp-iter_0000009").exists()
    beside = parse("gpt", flags).beside
    assert list(beside) == ["tokenizer_args.json"]  # GPT-2's files are named by their paths
    assert beside["tokenizer_args.json"] == (x / "tokenizer_args.json").read_bytes()
