"""The fault table of silently wrong input: each reproduction as a user runs it, and what it does now.

Training runs are the tiny two-stage model of the issue, launched as rank 0 of a world of 2 (the
checks run before any process group, so one process shows what every rank does), plus one real
two-process torchrun for the vocabulary mismatch. Each must exit 2 with one line on stderr that
names the file or flag and the fix. Preprocessing runs tools/preprocess_data.py: bad input exits
2 with one line naming the line, and leaves the output prefix exactly as it was.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_2bw.data.default_corpus import corpus_documents
from megatron_2bw.data.indexed_dataset import IndexedDatasetBuilder, MMapIndexedDataset
from megatron_2bw.data.preprocess import preprocess_jsonl
from megatron_2bw.data.tokenizer import train_sentencepiece

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import preprocess_data  # noqa: E402
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--pipeline-model-parallel-size", "2", "--train-iters", "2"]


def run(argv, world=None, timeout=120):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(WANDB_MODE="offline", PYTHONPATH=str(ROOT))
    if world is not None:  # rank 0 of a torchrun launch
        env.update(RANK="0", WORLD_SIZE=str(world), LOCAL_RANK="0")
    return subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


def one_line(proc, *words) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    for word in words:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"
    return lines[0]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Tokenizers of 1000 and 400 pieces, data preprocessed with the 1000-piece one and with a
    1000-id NullTokenizer, and corrupt or empty copies."""
    d = tmp_path_factory.mktemp("bad-inputs")
    docs = corpus_documents()
    lines = [ln for doc in docs for ln in doc.splitlines() if ln.strip()]
    for size in (1000, 400):
        train_sentencepiece(lines, str(d / f"sp{size}.model"), size, "bpe")
    (d / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[:40]))
    preprocess_jsonl(str(d / "corpus.jsonl"), str(d / "sp1000"),
                     tokenizer_model=str(d / "sp1000.model"), append_eod=True, log_interval=0)
    rng = np.random.RandomState(0)
    (d / "null.jsonl").write_text("".join(
        json.dumps({"text": " ".join(map(str, rng.randint(0, 1000, 40)))}) + "\n"
        for _ in range(50)))
    preprocess_jsonl(str(d / "null.jsonl"), str(d / "null1000"), tokenizer_type="NullTokenizer",
                     vocab_size=1000, append_eod=True, log_interval=0)
    good = str(d / "null1000_text_document")
    for name, edit in (("negative", _negative_length), ("overlap", _overlapping_length),
                       ("relabelled", _relabel_uint8)):
        for ext in (".bin", ".idx"):
            shutil.copy(good + ext, d / f"{name}{ext}")
        idx = d / f"{name}.idx"
        idx.write_bytes(edit(bytearray(idx.read_bytes())))
    IndexedDatasetBuilder(str(d / "empty.bin"), np.uint16).finalize(str(d / "empty.idx"))
    return d


def _lengths(raw: bytearray) -> np.ndarray:
    count = int.from_bytes(raw[18:26], "little")
    return np.frombuffer(raw, "<i4", count, 34)


def _negative_length(raw: bytearray) -> bytearray:
    raw[34 + 4 * 3 + 3] ^= 0x80  # the sign bit of sequence 3's length
    return raw


def _overlapping_length(raw: bytearray) -> bytearray:
    raw[34 + 4 * 3 + 1] ^= 0x01  # sequence 3 grows by 256 tokens, into sequence 4
    assert _lengths(raw)[3] > 256
    return raw


def _relabel_uint8(raw: bytearray) -> bytearray:
    assert raw[17] == 8
    raw[17] = 1  # uint16 -> uint8
    return raw


NULL = ["--tokenizer-type", "NullTokenizer"]
# (id, script, argv after the tiny model, words of the one line); "{d}" is the data directory
TRAINING = [
    ("vocab-mismatch-sentencepiece", "gpt",
     ["--data-path", "{d}/sp1000_text_document", "--tokenizer-model", "{d}/sp400.model"],
     ["sp1000_text_document.bin", "token ids go up to 99", "sp400.model has 400 ids",
      "preprocessed with another tokenizer", "--tokenizer-model"]),
    ("vocab-mismatch-null-tokenizer", "gpt",
     ["--data-path", "{d}/null1000_text_document", *NULL, "--vocab-size", "400"],
     ["token ids go up to 1000", "NullTokenizer (--vocab-size 400) has 401 ids",
      "pass --vocab-size 1000 or more"]),
    ("vocab-mismatch-null-tokenizer-without-vocab-size", "gpt",
     ["--data-path", "{d}/null1000_text_document", *NULL],
     ["--tokenizer-type NullTokenizer needs --vocab-size > 0"]),  # as in Megatron: no default
    ("idx-negative-length", "gpt", ["--data-path", "{d}/negative", *NULL, "--vocab-size", "1000"],
     ["negative.idx", "sequence 3 has length", "(negative)"]),
    ("idx-overlapping-lengths", "gpt",
     ["--data-path", "{d}/overlap", *NULL, "--vocab-size", "1000"],
     ["overlap.idx", "sequence 4 starts at byte", "lengths and pointers disagree"]),
    ("uint16-relabelled-uint8", "gpt",
     ["--data-path", "{d}/relabelled", *NULL, "--vocab-size", "1000"],
     ["relabelled.idx", "they fit 2-byte tokens", "header says uint8"]),
    ("empty-dataset-not-blamed-on-split", "gpt",
     ["--data-path", "{d}/empty", *NULL, "--vocab-size", "1000"],
     ["empty.idx", "no documents (an empty dataset)", "tools/preprocess_data.py"]),
    ("mask-prob-above-1", "bert", ["--mock-data", "--mask-prob", "1.5"],
     ["--mask-prob 1.5", "[0, 1]"]),
    ("recompute-more-layers-than-the-model", "gpt",
     ["--mock-data", "--recompute-granularity", "full", "--recompute-method", "uniform",
      "--recompute-num-layers", "5"], ["--recompute-num-layers 5", "--num-layers 2"]),
    ("deepspeed-json-unknown-top-level-key", "gpt",
     ["--mock-data", "--deepspeed_config", "{d}/typo.json"],
     ["unknown DeepSpeed config key 'gradient_cliping'", "did you mean 'gradient_clipping'"]),
    ("hidden-size-65536-refused-with-the-estimate", "gpt",
     ["--mock-data", "--hidden-size", "65536"],
     ["needs about", "GB per rank", "weights", "optimizer state", "free",
      "--pipeline-model-parallel-size", "--auto-plan", "--no-memory-check"]),
]


@pytest.mark.parametrize("script,argv,words", [c[1:] for c in TRAINING],
                         ids=[c[0] for c in TRAINING])
def test_training_on_bad_input_stops_in_one_line(data, monkeypatch, capsys, script, argv, words):
    """pretrain_{script}.py's flag parsing and checks (pretrain.parse) in this process, as rank 0
    of a two-process launch: exit 2 and one line, before any process group."""
    import torch.distributed as dist
    from megatron_2bw.pretrain import parse
    (data / "typo.json").write_text('{"train_batch_size": 8, "gradient_cliping": 1.0, '
                                    '"strict": true}')
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        parse(script, [*TINY, *[a.replace("{d}", str(data)) for a in argv]])
    out = capsys.readouterr()
    proc = subprocess.CompletedProcess([], exit_.value.code, out.out, out.err)
    assert "--split" not in one_line(proc, *words)
    assert not dist.is_initialized()


def test_vocab_mismatch_on_two_processes_is_one_line_per_rank_not_a_crash_mid_step(data):
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc = run([*launcher, "pretrain_gpt.py", *TINY, "--data-path",
                str(data / "sp1000_text_document"), "--tokenizer-model",
                str(data / "sp400.model")])
    assert proc.returncode != 0
    ours = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    # each rank checks on its own; torchrun may stop the second before it prints its line
    assert 1 <= len(ours) <= 2 and all("token ids go up to" in ln for ln in ours), proc.stderr
    for symptom in ("IndexError", "Connection reset", "iteration "):
        assert symptom not in proc.stderr + proc.stdout


def test_the_fixed_command_trains(data):
    proc = run(["pretrain_gpt.py", *TINY[:-4], "--pipeline-model-parallel-size", "1",
                "--train-iters", "2", "--data-path", str(data / "sp1000_text_document"),
                "--tokenizer-model", str(data / "sp1000.model")])
    assert proc.returncode == 0, proc.stderr
    assert "iteration        2/       2 |" in proc.stdout


# ---- preprocess_data.py: bad input writes nothing and leaves earlier outputs intact ---------
PREPROCESS = [
    ("empty-input", "", ["no documents", "empty"], 1),
    ("blank-lines-only", "\n\n  \n", ["no documents"], 1),
    ("null-text", '{"text": "1 2"}\n{"text": null}\n', ["line 2", "'text' is null"], 2),
    ("number-text", '{"text": "1 2"}\n{"text": 7}\n', ["line 2", "'text' is a number"], 1),
    ("missing-key", '{"text": "1 2"}\n{"body": "3"}\n', ["line 2", "no key 'text'", "'body'"],
     2),
    ("bad-json", '{"text": "1 2"}\n{"text": "3"\n', ["line 2", "not JSON"], 1),
    ("not-an-object", '{"text": "1 2"}\n["3"]\n', ["line 2", "a list, not a JSON object"], 1),
    ("no-text-at-all", '{"text": ""}\n{"text": ""}\n', ["the 2 documents have no text"], 1),
    ("text-for-the-null-tokenizer", '{"text": "1 2"}\n{"text": "1 two"}\n',
     ["line 2: 'text'", "space-separated token ids, got 'two'"], 2),
    ("id-beyond-the-null-tokenizer", '{"text": "1 2"}\n{"text": "3 250"}\n',
     ["line 2: 'text'", "token id 250 is outside the NullTokenizer's 0-100"], 1),
]


def preprocess(capsys, *argv) -> tuple[int, str]:
    """tools/preprocess_data.py's main in this process: (exit code, stderr)."""
    capsys.readouterr()
    code = preprocess_data.main(["--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
                                 "--log-interval", "0", *argv])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("text,words,workers", [c[1:] for c in PREPROCESS],
                         ids=[c[0] for c in PREPROCESS])
def test_preprocess_bad_input_writes_nothing(tmp_path, capsys, text, words, workers):
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text('{"text": "4 5 6"}\n')
    bad.write_text(text)
    out = ["--output-prefix", str(tmp_path / "out"), "--workers", str(workers)]
    assert preprocess(capsys, "--input", str(good), *out)[0] == 0
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    code, err = preprocess(capsys, "--input", str(bad), *out)
    lines = err.splitlines()
    assert code == 2 and len(lines) == 1, err
    for word in (str(bad), "nothing written", *words):
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # intact, no leftovers


def test_preprocess_bad_input_with_no_earlier_outputs_leaves_no_files(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "1 2"}\n{"text": null}\n')
    code, err = preprocess(capsys, "--input", str(bad), "--output-prefix", str(tmp_path / "out"))
    assert code == 2 and "line 2" in err
    assert [p.name for p in tmp_path.iterdir()] == ["bad.jsonl"]


def test_train_tokenizer_reports_null_text_not_the_string_none(tmp_path):
    src = tmp_path / "c.jsonl"
    src.write_text('{"text": "hello world"}\n{"text": null}\n')
    one_line(run(["tools/train_tokenizer.py", "--input", str(src), "--model-prefix",
                  str(tmp_path / "tok"), "--vocab-size", "50"]), "line 2", "'text' is null")
    assert not (tmp_path / "tok.model").exists()


def test_the_data_after_a_failed_rerun_still_loads(data, tmp_path):
    """A failed preprocessing run over an existing prefix: the old dataset still trains."""
    prefix = tmp_path / "c"
    preprocess_jsonl(str(data / "null.jsonl"), str(prefix), tokenizer_type="NullTokenizer",
                     vocab_size=1000, log_interval=0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(Path(data / "null.jsonl").read_text() + '{"txt": "1"}\n')
    with pytest.raises(ValueError, match="line 51: no key 'text'"):
        preprocess_jsonl(str(bad), str(prefix), tokenizer_type="NullTokenizer", vocab_size=1000,
                         log_interval=0)
    assert len(MMapIndexedDataset(f"{prefix}_text_document")) == 50


# ---- data against tokenizer (consistency.check_dataset), unit level --------------------------
def _dataset(path, tokens, dtype):
    b = IndexedDatasetBuilder(f"{path}.bin", dtype)
    b.add_document(tokens, [len(tokens)])
    b.finalize(f"{path}.idx")
    return MMapIndexedDataset(str(path))


@pytest.mark.parametrize("tokens,dtype,words", [
    ([1, 2, 3], np.uint8, ["token dtype uint8 holds ids up to 255", "has 1001"]),
    ([1, 2, 3], np.float32, ["token dtype float32 is not an integer type"]),
    ([5, -3, 7], np.int32, ["token ids go down to -3"]),
    ([5, 1001, 7], np.int32, ["token ids go up to 1001", "has 1001 ids (0-1000)"]),
])
def test_data_that_does_not_fit_the_vocabulary(tmp_path, tokens, dtype, words):
    from megatron_2bw.data.consistency import check_dataset
    from megatron_2bw.data.errors import DataError
    from megatron_2bw.data.tokenizer import NullTokenizer
    ds = _dataset(tmp_path / "d", tokens, dtype)
    with pytest.raises(DataError) as e:
        check_dataset(ds, NullTokenizer(1000), tmp_path / "cache")
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def test_token_range_is_scanned_once_per_file_version(tmp_path, monkeypatch):
    from megatron_2bw.data import consistency
    scans = []
    real = consistency.scan_token_range
    monkeypatch.setattr(consistency, "scan_token_range", lambda ds: scans.append(1) or real(ds))
    ds = _dataset(tmp_path / "d", [4, 9, 2], np.uint16)
    assert consistency.token_range(ds, tmp_path / "cache") == (2, 9)
    assert consistency.token_range(MMapIndexedDataset(str(tmp_path / "d")), tmp_path / "cache") \
        == (2, 9)
    assert len(scans) == 1
    ds = _dataset(tmp_path / "d", [4, 11, 2, 3], np.uint16)  # rewritten: scanned again
    assert consistency.token_range(ds, tmp_path / "cache") == (2, 11) and len(scans) == 2
