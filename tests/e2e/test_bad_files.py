"""Every input file is read inside a one-line error (config/input_files.py owns the reading).

Each reader is fed, through the command a user runs, the four kinds of bad file: binary
garbage, a file cut short, a file of the wrong type (a vocab.json whose ids are strings, a JSON
list where an object belongs, a JSON file where a text format belongs, ...) and the wrong
encoding (Latin-1 or UTF-16 text). Each must exit 2 with exactly one line on stderr that names
the bad file, and nothing may escape as a traceback (the commands run in this process: an
exception other than the exit fails the test). The same command with the good file succeeds,
so the line is about the file. The readers: GPT-2 vocab.json and merges.txt, BERT vocab.txt,
tiktoken, sentencepiece, a HuggingFace tokenizer directory, the JSONL corpus
(tools/preprocess_data.py); the DeepSpeed JSON (pretrain); tokenizer_args.json
(tools/generate.py); a HuggingFace config.json and model.safetensors
(tools/checkpoint_convert.py import); the planner's topology and profile JSON (tools/plan.py);
an engine trace (tools/plot_schedule.py, which exits 1 with its line, as its other errors do).
"""
from __future__ import annotations

import base64
import json
import shutil
import sys
from pathlib import Path
from typing import Callable, NamedTuple

import pytest

from inprocess import run_main  # noqa: E402  (tests/ is on the path: tests/conftest.py)

GARBAGE = bytes(range(256)) * 16
KINDS = ("binary", "truncated", "wrong-type", "wrong-encoding")


class Reader(NamedTuple):
    name: str
    file: str                      # the bad file's name in the case directory
    good: bytes
    wrong_type: bytes
    wrong_encoding: bytes
    run: Callable                  # (case directory) -> (exit code, stderr)
    cut: int | None = None         # bytes kept of `good` for "truncated" (default: a third)


def _json(value) -> bytes:
    return json.dumps(value, ensure_ascii=False, indent=1).encode()


def _preprocess(*flags):
    def run(d: Path):
        from megatron_2bw.cli.preprocess_data import main
        (d / "in.jsonl").exists() or (d / "in.jsonl").write_text('{"text": "hello world"}\n')
        return run_main(main, ["--input", d / "in.jsonl", "--output-prefix", d / "out",
                               "--log-interval", "0", *[str(f).format(d=d) for f in flags]])
    return run


GPT2_VOCAB = {t: i for i, t in enumerate(["h", "e", "l", "o", "Ġ", "w", "r", "d", "he", "ll",
                                          "Ã", "©", "<|endoftext|>"])}
GPT2_MERGES = "#version: 0.2\nh e\nl l\nÃ ©\n"
BERT_VOCAB = "".join(t + "\n" for t in ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello",
                                        "world", "café"))
TIKTOKEN = [{"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str": "x"}
            for i, t in enumerate([bytes([b]) for b in range(256)] + [b"he", b"ll"])]
GPT2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "{d}/vocab.json",
        "--merge-file", "{d}/merges.txt"]
TIKTOKEN_FLAGS = ["--tokenizer-type", "TikTokenizer", "--tokenizer-model", "{d}/tok.json",
                  "--tiktoken-pattern", "v2", "--vocab-size", "262",
                  "--tiktoken-num-special-tokens", "4"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """Good files the readers need besides the one under test: a sentencepiece model, a
    HuggingFace tokenizer directory, a checkpoint and its HuggingFace export."""
    d = tmp_path_factory.mktemp("good")
    from megatron_2bw.data.tokenizer import train_sentencepiece
    train_sentencepiece(["hello world", "foo bar baz"] * 50, str(d / "sp.model"), 300, "bpe",
                        hard_vocab_limit=False)
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers
    inner = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "hello": 2, "world": 3},
                                       unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(str(d / "hf-tok"))
    from megatron_2bw.checkpoint.convert.native import FullModel, write_checkpoint
    from megatron_2bw.models.families import model_parts
    from megatron_2bw.testing.reference import build_sequential
    from megatron_2bw.testing.verify import parse
    cfg, _ = parse(["--vocab-size", "64"])
    state = {n: p.detach() for n, p in build_sequential(cfg, model_parts(cfg)[0])
             .named_parameters()}
    write_checkpoint(str(d / "ckpt"), FullModel(cfg, state), 1, 1)
    from megatron_2bw.checkpoint.convert.cli import main as convert
    assert run_main(convert, ["export", "--load", d / "ckpt", "--save", d / "hf"]).returncode == 0
    return d


def _copy(src: Path, dst: Path):
    shutil.copytree(src, dst)
    return dst


def _generate(d: Path):
    from megatron_2bw.generate import main
    return run_main(main, ["--load", d / "ckpt", "--prompt", "3 5 7", "--max-new-tokens", "2"])


def _convert(d: Path):
    from megatron_2bw.checkpoint.convert.cli import main
    return run_main(main, ["import", "--load", d / "hf", "--save", d / "imported"])


def _plan(flag: str):
    def run(d: Path):
        from megatron_2bw.planner.cli import main
        return run_main(main, ["--num-gpus", "2", "--global-batch-size", "8", "--model",
                               "gpt-125m", flag, d / "plan.json"])
    return run


def _pretrain(d: Path):
    from megatron_2bw.pretrain import parse
    return run_main(lambda argv: parse("gpt", argv) and 0,
                    ["--mock-data", "--num-layers", "2", "--hidden-size", "32",
                     "--num-attention-heads", "2", "--seq-length", "16", "--no-memory-check",
                     "--deepspeed_config", d / "ds.json"])


def _plot(d: Path):
    from megatron_2bw.cli.plot_schedule import main

    def as_python_runs_it(argv):  # SystemExit("line"): Python prints the line, exit code 1
        try:
            return main(argv)
        except SystemExit as e:
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
            raise
    return run_main(as_python_runs_it, ["--trace", d / "trace.json", "--out", d / "trace.png"])


HF_CONFIG_BAD = {"model_type": "gpt2", "vocab_size": 64, "n_embd": "64", "n_layer": 2,
                 "n_head": 4, "n_positions": 32}
READERS = [
    Reader("gpt2-vocab.json", "vocab.json", _json(GPT2_VOCAB),
           _json({t: str(i) for t, i in GPT2_VOCAB.items()}), json.dumps(GPT2_VOCAB)
           .encode("utf-16"), _preprocess(*GPT2)),
    Reader("gpt2-merges.txt", "merges.txt", GPT2_MERGES.encode(), _json(GPT2_VOCAB),
           GPT2_MERGES.encode("latin-1"), _preprocess(*GPT2), cut=6),
    Reader("bert-vocab.txt", "vocab.txt", BERT_VOCAB.encode(), _json(BERT_VOCAB.split()),
           BERT_VOCAB.encode("latin-1"),
           _preprocess("--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file",
                       "{d}/vocab.txt"), cut=4),
    Reader("tiktoken.json", "tok.json", _json(TIKTOKEN), _json({"rank": 0}),
           json.dumps(TIKTOKEN).encode("utf-16"), _preprocess(*TIKTOKEN_FLAGS)),
    Reader("sentencepiece.model", "sp.model", b"", _json({"pieces": []}),
           "hello world".encode("utf-16"),
           _preprocess("--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model",
                       "{d}/sp.model")),
    Reader("hf-tokenizer.json", "hf-tok/tokenizer.json", b"", _json([1, 2]), b"",
           _preprocess("--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model",
                       "{d}/hf-tok")),
    Reader("corpus.jsonl", "in.jsonl", '{"text": "hello café"}\n'.encode(),
           _json([{"text": "hello"}]), '{"text": "hello café"}\n'.encode("latin-1"),
           _preprocess("--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model",
                       "{d}/sp.model"), cut=9),
    Reader("deepspeed.json", "ds.json", _json({"train_batch_size": 2}), _json([1, 2]),
           json.dumps({"train_batch_size": 2}).encode("utf-16"), _pretrain),
    Reader("tokenizer_args.json", "ckpt/tokenizer_args.json",
           _json({"tokenizer_type": "NullTokenizer", "vocab_size": 63}),
           _json({"tokenizer_type": "NullTokenizer", "vocab_size": "63"}),
           json.dumps({"tokenizer_type": "NullTokenizer"}).encode("utf-16"), _generate),
    Reader("hf-config.json", "hf/config.json", b"", _json(HF_CONFIG_BAD), b"", _convert),
    Reader("model.safetensors", "hf/model.safetensors", b"", _json({"weights": []}),
           "hello".encode("utf-16"), _convert),
    Reader("topology.json", "plan.json", _json({"gpus_per_node": 2}),
           _json({"gpus_per_node": "2"}), json.dumps({"gpus_per_node": 2}).encode("utf-16"),
           _plan("--topology")),
    Reader("profile.json", "plan.json", _json({"source": "analytic"}),
           _json({"source": "measured", "layers": 5}),
           json.dumps({"source": "analytic"}).encode("utf-16"), _plan("--profile")),
    Reader("trace.json", "trace.json", _json({"rank": 0, "events": [["F0v0", 0.0, 1.0]]}),
           _json({"rank": 0, "events": [1, 2]}),
           json.dumps({"rank": 0, "events": []}).encode("utf-16"), _plot),
]


def _case(assets: Path, tmp_path: Path, reader: Reader) -> tuple[Path, bytes]:
    """A case directory holding the good files, and the good bytes of the reader's file."""
    d = tmp_path / "case"
    d.mkdir()
    for name in ("sp.model", "hf-tok", "ckpt", "hf"):
        (shutil.copytree if (assets / name).is_dir() else shutil.copy)(assets / name, d / name)
    for name, data in (("vocab.json", _json(GPT2_VOCAB)), ("merges.txt", GPT2_MERGES.encode()),
                       ("vocab.txt", BERT_VOCAB.encode()), ("tok.json", _json(TIKTOKEN))):
        (d / name).write_bytes(data)
    good = reader.good or (d / reader.file).read_bytes()
    (d / reader.file).write_bytes(good)
    return d, good


@pytest.mark.parametrize("reader", READERS, ids=[r.name for r in READERS])
def test_the_good_file_is_read(assets, tmp_path, reader):
    d, _ = _case(assets, tmp_path, reader)
    proc = reader.run(d)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reader", READERS, ids=[r.name for r in READERS])
def test_a_bad_file_is_one_line_naming_it(assets, tmp_path, reader, kind):
    d, good = _case(assets, tmp_path, reader)
    bad = {"binary": GARBAGE, "truncated": good[:reader.cut or max(len(good) // 3, 1)],
           "wrong-type": reader.wrong_type,
           "wrong-encoding": reader.wrong_encoding or good.decode("utf-8", "replace")
           .encode("utf-16")}[kind]
    (d / reader.file).write_bytes(bad)
    proc = reader.run(d)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == (1 if reader.run is _plot else 2), proc.stderr
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert str(d / reader.file) in lines[0] or str(d / Path(reader.file).parent) in lines[0], \
        lines[0]


WHAT = [("gpt2-vocab.json", "wrong-type", 'the id of "h" is the string "0", not an integer >= 0'),
        ("gpt2-merges.txt", "binary", "binary data, not text; check it is the right file"),
        ("gpt2-merges.txt", "wrong-encoding", "not UTF-8 text (byte 0xc3 at offset 22, line 4"),
        ("tiktoken.json", "binary", "binary data, not text"),
        ("deepspeed.json", "wrong-type", "a JSON list where a JSON object {...} belongs"),
        ("deepspeed.json", "wrong-encoding", "UTF-16 text (it starts with a UTF-16 byte-order "
                                             "mark), not UTF-8; save it as UTF-8"),
        ("tokenizer_args.json", "wrong-type", 'vocab_size is the string "63", not an integer'),
        ("hf-config.json", "wrong-type", 'n_embd is the string "64", not a positive integer'),
        ("hf-config.json", "truncated", "is the file cut short?"),
        ("model.safetensors", "truncated", "not a safetensors file"),
        ("corpus.jsonl", "wrong-encoding", "line 1: not UTF-8 text (byte 0xe9 at column 20"),
        ("bert-vocab.txt", "wrong-type", "a JSON document, not one token a line")]


@pytest.mark.parametrize("name,kind,words", WHAT, ids=[f"{n}-{k}" for n, k, _ in WHAT])
def test_the_line_says_what_is_wrong(assets, tmp_path, name, kind, words):
    """The issue's cases by name: binary merges.txt and tiktoken files (UnicodeDecodeError
    before), a vocab.json with string ids (TypeError before), and what each kind is called."""
    reader = next(r for r in READERS if r.name == name)
    d, good = _case(assets, tmp_path, reader)
    bad = {"binary": GARBAGE, "truncated": good[:max(len(good) // 3, 1)],
           "wrong-type": reader.wrong_type, "wrong-encoding": reader.wrong_encoding}[kind]
    (d / reader.file).write_bytes(bad)
    proc = reader.run(d)
    assert words in proc.stderr, proc.stderr
