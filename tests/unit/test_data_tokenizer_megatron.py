"""Megatron-LM's tokenizer types on tiny files built here (nothing downloaded): the ids,
special tokens and eod each class of Megatron-LM gives for the same files.

The expected ids are worked out by hand from Megatron's algorithms (GPT-2 byte-level BPE,
BERT's basic tokenization + greedy longest-match WordPiece, tiktoken's rank merges with the
special-token offset, bos/eos as Megatron adds them); the well-kept libraries, where
installed, are a second witness (HuggingFace `tokenizers`).
"""
import argparse
import base64
import json

import numpy as np
import pytest

from megatron_2bw.data.build import build_gpt_train_data, pretrain_tokenizer
from megatron_2bw.data.errors import DataError
from megatron_2bw.data.indexed_dataset import MMapIndexedDataset
from megatron_2bw.data.preprocess import preprocess_jsonl
from megatron_2bw.data.tokenizer import build_tokenizer, tokenizer_from_args
from megatron_2bw.data.tokenizer_base import need_package

GPT2_VOCAB = ["h", "e", "l", "o", "Ġ", "w", "r", "d", "he", "ll", "hell", "hello", "Ġw", "or",
              "Ġwor", "'", "s", "Ã©", "<|endoftext|>", "Ã", "©", "Ċ"]
GPT2_MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ã ©"]


@pytest.fixture
def gpt2_files(tmp_path):
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab.write_text(json.dumps({t: i for i, t in enumerate(GPT2_VOCAB)}), encoding="utf-8")
    merges.write_text("#version: 0.2\n" + "\n".join(GPT2_MERGES) + "\n", encoding="utf-8")
    return str(vocab), str(merges)


def test_gpt2_bpe_ids(gpt2_files, tmp_path):
    vocab, merges = gpt2_files
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    # "hello": h+e (rank 0), l+l (1), he+ll (2), hell+o (3) -> hello = 11.
    # " world" -> Ġ w o r l d: Ġ+w (4), o+r (5), Ġw+or (6) -> Ġwor l d = 14 2 7.
    assert tok.tokenize("hello world") == [11, 14, 2, 7]
    # "he's" -> "he" "'s" (GPT-2's contraction piece; no merge for ' s); " é" -> bytes C3 A9
    # -> Ġ Ã © -> Ġ Ã© (rank 7)
    assert tok.tokenize("he's é") == [8, 15, 16, 4, 17]
    assert tok.tokenize("hello!") == [11, 0]  # "!" is not in vocab.json: id 0, as Megatron
    assert tok.eod == tok.eos == 18 and tok.vocab_size == len(GPT2_VOCAB)
    assert 18 not in tok.tokenize("<|endoftext|>")  # the eod string is plain text
    assert tok.detokenize(tok.tokenize("hello world he's é")) == "hello world he's é"
    # Megatron drops merges.txt's first line and whatever follows its last newline
    cut = tmp_path / "cut.txt"
    cut.write_text("#version: 0.2\n" + "\n".join(GPT2_MERGES[:7]), encoding="utf-8")
    assert build_tokenizer("GPT2BPETokenizer", vocab_file=vocab,
                           merge_file=str(cut)).tokenize(" world") == [12, 13, 2, 7]


def test_gpt2_bpe_matches_huggingface_tokenizers(gpt2_files):
    tokenizers = pytest.importorskip("tokenizers")
    vocab, merges = gpt2_files
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    theirs = tokenizers.ByteLevelBPETokenizer(vocab, merges)
    for text in ("hello world", "he's é hello", "  hello\n\nworld  ", "ééé hellohello"):
        assert ours.tokenize(text) == theirs.encode(text).ids, text


BERT_VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "quick", "brown", "fox",
              "jump", "##s", "##ed", "un", "##aff", "##able", ",", ".", "cafe", "中", "The",
              "##x"]


@pytest.fixture
def bert_vocab(tmp_path):
    path = tmp_path / "vocab.txt"
    path.write_text("".join(t + "\n" for t in BERT_VOCAB), encoding="utf-8")
    return str(path)


def test_bert_wordpiece_lower_case_ids(bert_vocab):
    tok = build_tokenizer("BertWordPieceLowerCase", vocab_file=bert_vocab)
    n = len(BERT_VOCAB)
    # lower-cased, accents stripped (Café -> cafe), punctuation split off, greedy longest match
    text = "The Quick, brown FOX jumps! Café unaffable."
    assert tok.tokenize(text) == [5, 6, 15, 7, 8, 9, 10, 1, 17, 12, 13, 14, 16]
    # CJK ideographs stand alone; NUL and format characters (U+200B) are dropped
    assert tok.tokenize("中中 fo\u200bx f\x00ox") == [18, 18, 8, 8]
    assert tok.tokenize("foxjumps") == [1]  # "fox" then no "##jumps"/"##jump..": [UNK]
    assert tok.tokenize("fox" * 70) == [1]  # over 200 characters: [UNK]
    assert (tok.pad, tok.cls, tok.sep, tok.mask) == (0, 2, 3, 4)
    assert (tok.bos, tok.eos, tok.eod, tok.vocab_size) == (n, n + 1, n + 1, n + 2)  # appended
    assert tok.detokenize([9, 10, 8, 20]) == "jumps foxx"  # "##x" joins its word


def test_bert_wordpiece_case_and_extra_ids(bert_vocab):
    tok = build_tokenizer("BertWordPieceCase", vocab_file=bert_vocab, vocab_extra_ids=3)
    n = len(BERT_VOCAB)
    # cased: "The" is its own entry, "Quick"/"FOX" are unknown, accents are kept (Café: [UNK])
    assert tok.tokenize("The the Quick FOX Café") == [19, 5, 1, 1, 1]
    assert tok.vocab_size == n + 2 + 3 and tok.vocab["<extra_id_2>"] == n + 4


def test_bert_wordpiece_matches_huggingface_tokenizers(bert_vocab):
    tokenizers = pytest.importorskip("tokenizers")
    for lower, ttype in ((True, "BertWordPieceLowerCase"), (False, "BertWordPieceCase")):
        ours = build_tokenizer(ttype, vocab_file=bert_vocab)
        theirs = tokenizers.BertWordPieceTokenizer(bert_vocab, lowercase=lower)
        for text in ("The Quick, brown FOX jumps! Café unaffable.", "中中 fox,fox...the"):
            assert ours.tokenize(text) == theirs.encode(text, add_special_tokens=False).ids


def test_bert_vocab_without_specials_is_one_line(tmp_path):
    path = tmp_path / "v.txt"
    path.write_text("a\nb\n")
    with pytest.raises(DataError, match=r"no \[CLS\] \[SEP\] \[PAD\] \[MASK\] \[UNK\] line"):
        build_tokenizer("BertWordPieceCase", vocab_file=str(path))


def tiktoken_json(path, extra=(b"he", b"ll", b"hell", b"hello", b" w", b"or", b" wor")):
    tokens = [bytes([b]) for b in range(256)] + list(extra)
    path.write_text(json.dumps([{"rank": i, "token_bytes": base64.b64encode(t).decode(),
                                 "token_str": t.decode("latin-1")}
                                for i, t in enumerate(tokens)]))
    return str(path)


def test_tiktoken_ids_with_megatron_special_offset(tmp_path):
    pytest.importorskip("tiktoken")
    path = tiktoken_json(tmp_path / "tok.json")
    tok = build_tokenizer("TikTokenizer", path, vocab_size=4 + 263, tiktoken_pattern="v2",
                          tiktoken_num_special_tokens=4)
    # ids 0-3: <unk> <s> </s> <SPECIAL_3>; rank r -> id r + 4. "hello": he (256), ll (257),
    # hell (258), hello (259) -> 263; " world": " w" (260), "or" (261), " wor" (262), l, d
    assert tok.tokenize("hello world") == [263, 266, ord("l") + 4, ord("d") + 4]
    assert tok.tokenize("<s>") == [ord("<") + 4, ord("s") + 4, ord(">") + 4]  # not special
    assert (tok.bos, tok.eos, tok.eod, tok.vocab_size) == (1, 2, 2, 267)
    assert tok.detokenize(tok.tokenize("hello world")) == "hello world"
    # --vocab-size cuts the file: only ranks below vocab_size - N are used
    small = build_tokenizer("TikTokenizer", path, vocab_size=4 + 260, tiktoken_pattern="v1",
                            tiktoken_num_special_tokens=4)
    assert small.tokenize(" world") == [c + 4 for c in b" world"]
    # tiktoken's own "base64 rank" lines give the same ids
    lines = tmp_path / "tok.tiktoken"
    lines.write_text("".join(f"{e['token_bytes']} {e['rank']}\n"
                             for e in json.load(open(path))))
    same = build_tokenizer("TikTokenizer", str(lines), vocab_size=267, tiktoken_pattern="v2",
                           tiktoken_num_special_tokens=4)
    assert same.tokenize("hello world") == tok.tokenize("hello world")


def test_tiktoken_bad_inputs_are_one_line(tmp_path):
    path = tiktoken_json(tmp_path / "tok.json")
    for kwargs, words in (({"tiktoken_pattern": "v3"}, "--tiktoken-pattern v1 or v2"),
                          ({"tiktoken_pattern": "v2", "vocab_size": 5000,
                            "tiktoken_num_special_tokens": 4}, "pass --vocab-size 267"),
                          ({"tiktoken_pattern": "v2", "vocab_size": 267,
                            "tiktoken_num_special_tokens": 2}, "--tiktoken-num-special-tokens 2"),
                          ({"tiktoken_pattern": "v2", "vocab_size": 267,
                            "tokenizer_special_tokens": ["<s>", "</s>"]}, "include <unk>")):
        if "tiktoken" in words or "vocab-size" in words or "include" in words:
            pytest.importorskip("tiktoken")
        with pytest.raises(DataError, match=words.replace("<", ".")) as e:
            build_tokenizer("TikTokenizer", path, **kwargs)
        assert "\n" not in str(e.value)
    with pytest.raises(DataError, match="needs the tiktoken package: pip install tiktoken"):
        need_package("no_such_module_for_this_test", "TikTokenizer", "tiktoken")


def test_llama2_tokenizer_prepends_bos(tmp_path):
    from megatron_2bw.data.tokenizer import train_sentencepiece
    lines = [f"the fox number {i} jumps over the lazy dog" for i in range(200)]
    model = train_sentencepiece(lines, str(tmp_path / "sp.model"), 320, "bpe")
    tok = build_tokenizer("Llama2Tokenizer", model)
    import sentencepiece
    sp = sentencepiece.SentencePieceProcessor(model_file=model)
    text = "the lazy fox jumps"
    assert tok.tokenize(text) == [1] + sp.encode(text)  # Megatron: bos=True, eos=False
    assert (tok.bos, tok.eos, tok.eod, tok.vocab_size) == (1, 2, 2, 320)
    assert tok.detokenize(tok.tokenize(text)) == text


@pytest.fixture
def hf_dir(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, "hello": 4, "world": 5}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    inner.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                         special_tokens=[("<s>", 1)])
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="<s>",
                                                eos_token="</s>", pad_token="<pad>",
                                                unk_token="<unk>")
    fast.add_tokens(["newword"])
    fast.save_pretrained(str(tmp_path / "hf"))
    return str(tmp_path / "hf")


def test_huggingface_tokenizer_local_directory(hf_dir, tmp_path):
    tok = build_tokenizer("HuggingFaceTokenizer", hf_dir)
    # Megatron: tokenizer(text).input_ids, so the post-processor's <s> is included
    assert tok.tokenize("hello world newword nope") == [1, 4, 5, 6, 0]
    assert (tok.eod, tok.eos, tok.bos, tok.pad) == (2, 2, 1, 3)
    assert tok.vocab_size == 7  # len(tokenizer): the added token included
    for bad in (str(tmp_path / "missing"), str(tmp_path)):
        with pytest.raises(DataError, match="HuggingFaceTokenizer|transformers cannot") as e:
            build_tokenizer("HuggingFaceTokenizer", bad)
        assert "\n" not in str(e.value)


def test_flags_reach_the_tokenizer_and_padding(gpt2_files, tmp_path):
    vocab, merges = gpt2_files
    # no --tokenizer-type, as in Megatron's GPT-3 example: --vocab-file + --merge-file imply
    # GPT2BPETokenizer; with --mock-data the tokenizer still sizes the vocabulary
    args = argparse.Namespace(mock_data=True, tokenizer_type=None, vocab_file=vocab,
                              merge_file=merges, vocab_size=None,
                              make_vocab_size_divisible_by=8, tensor_model_parallel_size=2)
    tok, padded = pretrain_tokenizer(args, "gpt")
    assert tok.name == "GPT2BPETokenizer" and tok.vocab_size == 22
    assert padded == 32  # ceil(22 / (8 x 2)) x (8 x 2), Megatron's _vocab_size_with_padding
    with pytest.raises(DataError, match="GPT2BPETokenizer needs --merge-file"):
        tokenizer_from_args(argparse.Namespace(tokenizer_type="GPT2BPETokenizer",
                                               vocab_file=vocab))
    with pytest.raises(DataError, match="missing.json: not found \\(--vocab-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "missing.json"),
                        merge_file=merges)


def test_preprocess_and_train_with_gpt2_bpe(gpt2_files, tmp_path):
    vocab, merges = gpt2_files
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n"
                              for t in ["hello world", "he's é", "hello hello world"] * 4))
    options = {"vocab_file": vocab, "merge_file": merges}
    out = preprocess_jsonl(str(corpus), str(tmp_path / "d"), tokenizer_type="GPT2BPETokenizer",
                           append_eod=True, tokenizer_options=options)["text"]
    ds = MMapIndexedDataset(out)
    assert ds[0].tolist() == [11, 14, 2, 7, 18] and ds[1].tolist() == [8, 15, 16, 4, 17, 18]
    args = argparse.Namespace(data_path=[out], split="1", tokenizer_type="GPT2BPETokenizer",
                              vocab_file=vocab, merge_file=merges,
                              data_cache_path=str(tmp_path / "cache"))
    data = build_gpt_train_data(args, seq_length=4, seed=1, num_samples=8)
    assert data.tokenizer.eod == 18 and data.vocab_size == 128 and len(data.dataset) >= 8
    assert np.all(data.dataset[0].numpy() < len(GPT2_VOCAB))


def test_checkpoint_records_the_tokenizer_files(gpt2_files, bert_vocab, tmp_path):
    from megatron_2bw.checkpoint.convert.tokenizers import record_tokenizer, recorded_tokenizer
    vocab, merges = gpt2_files
    for ttype, options in (("GPT2BPETokenizer", {"vocab_file": vocab, "merge_file": merges}),
                           ("BertWordPieceCase", {"vocab_file": bert_vocab,
                                                  "vocab_extra_ids": 2})):
        tok = build_tokenizer(ttype, **options)
        where = tmp_path / ttype
        where.mkdir()
        record_tokenizer(str(where), tok)
        again = recorded_tokenizer(str(where))
        assert again.name == ttype and again.vocab_size == tok.vocab_size
        assert again.tokenize("hello world the fox") == tok.tokenize("hello world the fox")


def test_bert_pretraining_data_with_wordpiece(bert_vocab, tmp_path):
    """`--vocab-file` alone (Megatron's BERT example) means BertWordPieceLowerCase; its
    [CLS]/[SEP]/[MASK] frame the BERT samples."""
    from megatron_2bw.data.build import build_bert_train_data
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": "The quick fox jumps. The brown fox jumped. "
                                               "Unaffable cafe fox."}) + "\n"
                           for _ in range(30)))
    out = preprocess_jsonl(str(src), str(tmp_path / "b"), tokenizer_type="BertWordPieceLowerCase",
                           split_sentences=True, tokenizer_options={"vocab_file": bert_vocab})
    args = argparse.Namespace(data_path=[out["text"]], split="1", vocab_file=bert_vocab,
                              data_cache_path=str(tmp_path / "cache"))
    data = build_bert_train_data(args, seq_length=16, seed=1, num_samples=8)
    assert data.tokenizer.name == "BertWordPieceLowerCase" and data.vocab_size == 128
    tokens = data.dataset[0]["tokens"].tolist()
    assert tokens[0] == 2 and tokens.count(3) == 2  # [CLS] A [SEP] B [SEP]


def test_data_beyond_the_vocabulary_names_the_files(gpt2_files, tmp_path):
    vocab, merges = gpt2_files
    src = tmp_path / "n.jsonl"
    src.write_text(json.dumps({"text": "1 2 300"}) + "\n")
    out = preprocess_jsonl(str(src), str(tmp_path / "n"), tokenizer_type="NullTokenizer",
                           vocab_size=1000)["text"]
    args = argparse.Namespace(data_path=[out], split="1", vocab_file=vocab, merge_file=merges,
                              data_cache_path=str(tmp_path / "cache"))
    with pytest.raises(DataError) as e:
        build_gpt_train_data(args, seq_length=2, seed=1, num_samples=1)
    line = str(e.value)
    assert f"GPT2BPETokenizer --vocab-file {vocab} --merge-file {merges} has 22 ids" in line
    assert "token ids go up to 300" in line and "tokenizer files" in line and "\n" not in line
