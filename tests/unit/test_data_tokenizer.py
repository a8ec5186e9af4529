"""Tokenizers (Megatron's special-token conventions), vocab padding, tools/train_tokenizer.py."""
import json
import sys
from pathlib import Path

import pytest

from megatron_2bw.data.errors import DataError
from megatron_2bw.data.tokenizer import (GPTSentencePieceTokenizer, NullTokenizer,
                                         SentencePieceTokenizer, build_tokenizer,
                                         train_sentencepiece, vocab_size_with_padding)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import train_tokenizer  # noqa: E402


def corpus_lines(n_topics=20):
    from pydoc_data.topics import topics
    return [ln for k in sorted(topics)[:n_topics] for ln in topics[k].splitlines() if ln.strip()]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tok.model"
    return train_sentencepiece(corpus_lines(), str(path), 400, "unigram")


def test_gpt_sentencepiece(model):
    tok = GPTSentencePieceTokenizer(model)
    assert tok.vocab_size == 400 and tok.eod == tok.eos == 2 and tok.pad == 3 and tok.bos == 1
    ids = tok.tokenize("The if statement is used for conditional execution.")
    assert ids and max(ids) < 400
    assert tok.detokenize(ids) == "The if statement is used for conditional execution."
    with pytest.raises(DataError, match="SentencePieceTokenizer"):
        tok.cls


def test_sentencepiece_adds_bert_specials(model):
    tok = SentencePieceTokenizer(model)
    assert tok.vocab_size == 404  # <CLS> <SEP> <EOD> <MASK> appended; pad/bos/eos are the model's
    assert [tok.cls, tok.sep, tok.eod, tok.mask] == [400, 401, 402, 403]
    assert (tok.pad, tok.bos, tok.eos) == (3, 1, 2)
    ids = tok.tokenize("a <MASK> b<SEP>")
    assert tok.mask in ids and ids[-1] == tok.sep
    assert "<MASK>" in tok.detokenize(ids)
    assert set(tok.special_ids) >= {400, 401, 402, 403, 1, 2, 3}


def test_null_tokenizer():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert tok.tokenize("1 2 99") == [1, 2, 99] and tok.eod == 100 and tok.vocab_size == 101
    assert tok.detokenize([4, 5]) == "4 5"
    with pytest.raises(DataError, match="--vocab-size"):
        NullTokenizer(0)


def test_vocab_padding():
    assert vocab_size_with_padding(2000) == 2048
    assert vocab_size_with_padding(2048) == 2048
    assert vocab_size_with_padding(404, 128, 2) == 512
    assert vocab_size_with_padding(101, 1) == 101


@pytest.mark.parametrize("ttype", ["SentencePieceTokenizer", "GPTSentencePieceTokenizer"])
def test_bad_tokenizer_model_is_one_line(tmp_path, ttype):
    for path, words in ((tmp_path / "missing.model", "not found"),
                        (tmp_path / "junk.model", "not a sentencepiece model")):
        if "junk" in path.name:
            path.write_bytes(b"\x00garbage" * 10)
        with pytest.raises(DataError) as e:
            build_tokenizer(ttype, str(path))
        assert str(path) in str(e.value) and words in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(DataError, match="--tokenizer-model"):
        build_tokenizer(ttype, None)
    with pytest.raises(DataError, match="--tokenizer-type"):
        build_tokenizer("GPT2BPETokenizer")


def test_train_tokenizer_tool(tmp_path, capsys):
    text = tmp_path / "a.txt"
    text.write_text("\n".join(corpus_lines(10)))
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_text("".join(json.dumps({"text": ln}) + "\n" for ln in corpus_lines(10)))
    for src, mtype in ((text, "bpe"), (jsonl, "unigram")):
        prefix = tmp_path / f"tok_{mtype}"
        assert train_tokenizer.main(["--input", str(src), "--model-prefix", str(prefix),
                                     "--vocab-size", "500", "--model-type", mtype,
                                     "--workers", "1"]) == 0
        tok = GPTSentencePieceTokenizer(f"{prefix}.model")
        assert tok.vocab_size == 500 and tok.eod == 2
    assert train_tokenizer.main(["--input", str(tmp_path / "none.txt"), "--model-prefix",
                                 str(tmp_path / "x")]) == 2
    assert "none.txt" in capsys.readouterr().err
    assert train_tokenizer.main(["--input", str(text), "--model-prefix", str(tmp_path / "x"),
                                 "--vocab-size", "100000"]) == 2
    err = capsys.readouterr().err.strip()
    assert "x.model" in err and "lower --vocab-size" in err and "\n" not in err
    assert train_tokenizer.main(["--input", str(text), "--model-prefix", str(tmp_path / "x"),
                                 "--vocab-size", "100"]) == 2
    assert "raise --vocab-size" in capsys.readouterr().err
