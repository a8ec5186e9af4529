"""Megatron-LM's tokenizers by their `--tokenizer-type` names (ids equal to Megatron's for the
same files), `build_tokenizer`, vocabulary padding and sentencepiece training.

- `SentencePieceTokenizer`: a sentencepiece model plus the special tokens BERT needs (<CLS>,
  <SEP>, <EOD>, <MASK>, and pad/bos/eos), appended after the model's pieces when the model lacks
  them, exactly as Megatron-LM does; text containing a special token's string maps to its id.
- `GPTSentencePieceTokenizer`: the bare model; eod is the model's eos.
- `Llama2Tokenizer`: the bare model with bos prepended to every text; eod = eos.
- `NullTokenizer(vocab_size)`: text is space-separated ids; eod = vocab_size (one extra id).
- GPT2BPETokenizer (tokenizer_gpt2.py), BertWordPieceLowerCase / BertWordPieceCase
  (tokenizer_wordpiece.py), HuggingFaceTokenizer (tokenizer_hf.py), TikTokenizer
  (tokenizer_tiktoken.py).
"""
from __future__ import annotations

import io
import os
from typing import Iterable

from megatron_2bw.data.errors import DataError
from megatron_2bw.data.tokenizer_base import Tokenizer
from megatron_2bw.fs import atomic_write_bytes

TOKENIZER_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer",
                   "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "HuggingFaceTokenizer",
                   "Llama2Tokenizer", "TikTokenizer", "NullTokenizer")
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")


def _load_sentencepiece(model_file: str):
    if not model_file:
        raise DataError("--tokenizer-model is required for the sentencepiece tokenizers: pass "
                        "FILE.model (train one with tools/train_tokenizer.py)")
    if not os.path.isfile(model_file):
        raise DataError(f"{model_file}: tokenizer model not found (--tokenizer-model): pass an "
                        "existing .model file or train one with tools/train_tokenizer.py")
    import sentencepiece
    sp = sentencepiece.SentencePieceProcessor()
    try:
        sp.Load(model_file)
    except (OSError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"{model_file}: not a sentencepiece model ({first}): pass a .model "
                        "file written by sentencepiece / tools/train_tokenizer.py") from None
    return sp


class GPTSentencePieceTokenizer(Tokenizer):
    name = "GPTSentencePieceTokenizer"

    def __init__(self, model_file: str):
        self.model_file = model_file
        self.sp = _load_sentencepiece(model_file)
        self._pad_id, self._bos_id = self.sp.pad_id(), self.sp.bos_id()
        self._eos_id = self._eod_id = self.sp.eos_id()

    @property
    def vocab_size(self) -> int:
        return self.sp.GetPieceSize()

    def tokenize(self, text: str) -> list[int]:
        return self.sp.EncodeAsIds(text)

    def detokenize(self, ids) -> str:
        return self.sp.DecodeIds([int(i) for i in ids])


class SentencePieceTokenizer(GPTSentencePieceTokenizer):
    """Megatron's _SentencePieceTokenizer: adds <CLS> <SEP> <EOD> <MASK> (+ pad/bos/eos)."""
    name = "SentencePieceTokenizer"

    def __init__(self, model_file: str, vocab_extra_ids: int = 0):
        super().__init__(model_file)
        self.vocab = {self.sp.IdToPiece(i): i for i in range(self.sp.GetPieceSize())}
        self.inv_vocab = {i: t for t, i in self.vocab.items()}
        self.special_tokens: dict[str, int] = {}

        def add(token: str) -> int:
            if token not in self.vocab:
                self.vocab[token] = len(self.inv_vocab)
                self.inv_vocab[self.vocab[token]] = token
            self.special_tokens[token] = self.vocab[token]
            return self.vocab[token]

        self._cls_id, self._sep_id = add("<CLS>"), add("<SEP>")
        self._eod_id, self._mask_id = add("<EOD>"), add("<MASK>")
        for attr, sp_id, default in (("_pad_id", self.sp.pad_id(), "<PAD>"),
                                     ("_bos_id", self.sp.bos_id(), "<BOS>"),
                                     ("_eos_id", self.sp.eos_id(), "<EOS>")):
            piece = self.sp.IdToPiece(sp_id) if 0 <= sp_id < self.sp.GetPieceSize() else default
            setattr(self, attr, add(piece))
        for i in range(vocab_extra_ids):
            add(f"<extra_id_{i}>")
        self.special_ids = tuple(sorted(set(self.special_tokens.values())))

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def tokenize(self, text: str) -> list[int]:
        ids, idx = [], 0
        while True:
            found = {t: text.find(t, idx) for t in self.special_tokens}
            found = {t: i for t, i in found.items() if i >= 0}
            if not found:
                break
            token = min(found, key=lambda t: (found[t], -len(t)))
            ids += self.sp.EncodeAsIds(text[idx:found[token]])
            ids.append(self.special_tokens[token])
            idx = found[token] + len(token)
        return ids + self.sp.EncodeAsIds(text[idx:])

    def detokenize(self, ids) -> str:
        text, last, ids = "", 0, [int(i) for i in ids]
        specials = {i: t for t, i in self.special_tokens.items()}
        for i, tok in enumerate(ids):
            if tok in specials:
                text += self.sp.DecodeIds(ids[last:i]) + " " + specials[tok] + " "
                last = i + 1
        return text + self.sp.DecodeIds(ids[last:])


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Megatron's _Llama2Tokenizer: the sentencepiece model's ids with bos first (no eos)."""
    name = "Llama2Tokenizer"

    def tokenize(self, text: str) -> list[int]:
        return [self.sp.bos_id(), *self.sp.EncodeAsIds(text)]


class NullTokenizer(Tokenizer):
    """Text is space-separated token ids; eod is one id past them (Megatron's _NullTokenizer)."""
    name = "NullTokenizer"

    def __init__(self, vocab_size: int):
        if not vocab_size or vocab_size < 1:
            raise DataError("--tokenizer-type NullTokenizer needs --vocab-size > 0")
        self._eod_id = int(vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._eod_id + 1

    def tokenize(self, text: str) -> list[int]:
        try:
            ids = [int(x) for x in text.split()]
        except ValueError:
            word = next(x for x in text.split() if not x.lstrip("-").isdigit())
            raise DataError(f"the NullTokenizer reads space-separated token ids, got "
                            f"{word[:20]!r}: use a sentencepiece --tokenizer-model for text") \
                from None
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise DataError(f"token id {bad[0]} is outside the NullTokenizer's 0-"
                            f"{self.vocab_size - 1} (--vocab-size {self._eod_id}): raise "
                            "--vocab-size")
        return ids

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


# build_tokenizer's keyword options and the argparse attributes (data/flags.py) they come from
OPTION_DEFAULTS = {"vocab_file": None, "merge_file": None, "vocab_extra_ids": 0,
                   "tiktoken_pattern": None, "tiktoken_num_special_tokens": 1000,
                   "tokenizer_special_tokens": None, "trust_remote_code": False}


def tokenizer_options(args) -> dict:
    """build_tokenizer's keyword options from parsed flags (absent or None: the default)."""
    out = {}
    for key, default in OPTION_DEFAULTS.items():
        value = getattr(args, key, None)
        out[key] = default if value is None else value
    return out


def tokenizer_type_of(args) -> str | None:
    """--tokenizer-type, or the one Megatron-LM's example scripts imply without it:
    --vocab-file + --merge-file: GPT2BPETokenizer; --vocab-file alone: BertWordPieceLowerCase;
    None otherwise (the caller's default)."""
    ttype = getattr(args, "tokenizer_type", None)
    if ttype or not getattr(args, "vocab_file", None):
        return ttype
    return "GPT2BPETokenizer" if getattr(args, "merge_file", None) else "BertWordPieceLowerCase"


def tokenizer_from_args(args, tokenizer_type: str | None = None) -> Tokenizer:
    """The tokenizer of parsed flags (--tokenizer-type unless `tokenizer_type` is given)."""
    return build_tokenizer(tokenizer_type or tokenizer_type_of(args),
                           getattr(args, "tokenizer_model", None),
                           getattr(args, "vocab_size", None), **tokenizer_options(args))


def build_tokenizer(tokenizer_type: str, tokenizer_model: str | None = None,
                    vocab_size: int | None = None, **options) -> Tokenizer:
    """The `--tokenizer-type` tokenizer. tokenizer_model: `--tokenizer-model` (a sentencepiece
    file, a HuggingFace directory or a tiktoken vocabulary); vocab_size: `--vocab-size` (the
    NullTokenizer's and the TikTokenizer's); options: OPTION_DEFAULTS' keys. The result's
    `build_args` rebuild it: build_tokenizer(type, **build_args) (file paths made absolute)."""
    unknown = set(options) - set(OPTION_DEFAULTS)
    if unknown:
        raise TypeError(f"build_tokenizer: unknown options {sorted(unknown)}")
    tok = _build(tokenizer_type, tokenizer_model, vocab_size, {**OPTION_DEFAULTS, **options})
    absolute = lambda p: os.path.abspath(p) if p else p  # noqa: E731
    tok.build_args = {"tokenizer_model": absolute(tokenizer_model), "vocab_size": vocab_size,
                      **{k: absolute(v) if k in ("vocab_file", "merge_file") else v
                         for k, v in options.items() if v != OPTION_DEFAULTS[k]}}
    return tok


def _build(tokenizer_type: str, tokenizer_model, vocab_size, o: dict) -> Tokenizer:
    if tokenizer_type in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        from megatron_2bw.data.tokenizer_wordpiece import BertWordPieceTokenizer
        return BertWordPieceTokenizer(o["vocab_file"], tokenizer_type == "BertWordPieceLowerCase",
                                      o["vocab_extra_ids"])
    if tokenizer_type == "GPT2BPETokenizer":
        from megatron_2bw.data.tokenizer_gpt2 import GPT2BPETokenizer
        return GPT2BPETokenizer(o["vocab_file"], o["merge_file"])
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(tokenizer_model, o["vocab_extra_ids"])
    if tokenizer_type == "GPTSentencePieceTokenizer":
        return GPTSentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "Llama2Tokenizer":
        return Llama2Tokenizer(tokenizer_model)
    if tokenizer_type == "HuggingFaceTokenizer":
        from megatron_2bw.data.tokenizer_hf import HuggingFaceTokenizer
        return HuggingFaceTokenizer(tokenizer_model, o["trust_remote_code"])
    if tokenizer_type == "TikTokenizer":
        from megatron_2bw.data.tokenizer_tiktoken import TikTokenizer
        return TikTokenizer(tokenizer_model, o["tiktoken_pattern"], vocab_size,
                            o["tiktoken_num_special_tokens"], o["tokenizer_special_tokens"])
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    raise DataError(f"--tokenizer-type {tokenizer_type}: unknown; choose one of "
                    f"{', '.join(TOKENIZER_TYPES)}")


def vocab_size_with_padding(vocab_size: int, divisible_by: int = 128,
                            tensor_parallel_size: int = 1) -> int:
    """Megatron pads the embedding to a multiple of divisible_by x tensor-parallel size."""
    multiple = max(1, divisible_by) * max(1, tensor_parallel_size)
    return -(-vocab_size // multiple) * multiple


def train_sentencepiece(lines: Iterable[str], model_path: str, vocab_size: int,
                        model_type: str = "unigram", num_threads: int = 1,
                        character_coverage: float = 1.0, byte_fallback: bool = True,
                        **options) -> str:
    """Train a sentencepiece model on `lines` and write it to model_path (atomically).
    Ids: unk 0, bos 1, eos 2, pad 3. Returns model_path."""
    import sentencepiece
    if model_type not in ("unigram", "bpe"):
        raise DataError(f"--model-type {model_type}: choose unigram or bpe")
    buf = io.BytesIO()
    try:
        sentencepiece.SentencePieceTrainer.Train(
            sentence_iterator=iter(lines), model_writer=buf, vocab_size=vocab_size,
            model_type=model_type, num_threads=num_threads, minloglevel=2,
            character_coverage=character_coverage, byte_fallback=byte_fallback,
            unk_id=0, bos_id=1, eos_id=2, pad_id=3, max_sentence_length=1 << 16, **options)
    except RuntimeError as e:
        msg = " ".join(str(e).split())
        hint = ("raise --vocab-size" if "smaller than required" in msg else
                "lower --vocab-size or give more text")
        raise DataError(f"{model_path}: sentencepiece training failed ({msg}): {hint}") from None
    atomic_write_bytes(model_path, buf.getvalue())
    return model_path
