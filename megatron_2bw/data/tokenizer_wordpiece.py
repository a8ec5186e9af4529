"""Megatron's BertWordPieceLowerCase / BertWordPieceCase: BERT's WordPiece from `--vocab-file`
(one token per line, id = line number), with the ids Megatron-LM's bert_tokenization gives.

- basic tokenization: drop NUL, U+FFFD and control characters (Cc/Cf), whitespace -> space,
  spaces around CJK ideographs, split on whitespace; lower case: lower-case and strip accents
  (NFD, drop Mn); split off every punctuation character (ASCII non-alphanumerics and P*);
- WordPiece: greedy longest match from the left, continuation pieces prefixed "##"; a word
  that cannot be covered, or longer than 200 characters, is [UNK];
- special ids: [CLS] [SEP] [PAD] [MASK] from the vocabulary; [BOS] and [EOS] appended when
  absent (then `--vocab-extra-ids` <extra_id_i>); eod = eos = [EOS], as Megatron has it.
"""
from __future__ import annotations

import io
import unicodedata

from megatron_2bw.config.input_files import file_error, is_json_document, read_text
from megatron_2bw.data.errors import DataError
from megatron_2bw.data.tokenizer_base import Tokenizer, need_file

BERT_SPECIALS = ("[CLS]", "[SEP]", "[PAD]", "[MASK]", "[UNK]")
MAX_WORD_CHARS = 200
_CJK = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
        (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))


def read_vocab(path: str, fix: str = "--vocab-file must be BERT's vocab.txt (one token a line)"
               ) -> dict[str, int]:
    """Line k (stripped) -> k; a repeated token keeps its last line (BERT's load_vocab, which
    reads UTF-8 strictly: another encoding or binary data is one line, not dropped bytes)."""
    text = read_text(path, fix, DataError)
    if is_json_document(text):
        raise file_error(path, "a JSON document, not one token a line", fix, DataError)
    vocab = {}
    for index, line in enumerate(io.StringIO(text, newline=None)):
        vocab[line.strip()] = index
    return vocab


def _is_whitespace(c: str) -> bool:
    return c in " \t\n\r" or unicodedata.category(c) == "Zs"


def _is_control(c: str) -> bool:
    return c not in "\t\n\r" and unicodedata.category(c) in ("Cc", "Cf")


def _is_punctuation(c: str) -> bool:
    cp = ord(c)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(c).startswith("P")


def _is_cjk(c: str) -> bool:
    cp = ord(c)
    return any(lo <= cp <= hi for lo, hi in _CJK)


def basic_tokenize(text: str, lower_case: bool) -> list[str]:
    chars = []
    for c in text:
        if c in ("\x00", "\ufffd") or _is_control(c):
            continue
        c = " " if _is_whitespace(c) else c
        chars.append(f" {c} " if _is_cjk(c) else c)
    words = []
    for word in "".join(chars).split():
        if lower_case:
            word = "".join(c for c in unicodedata.normalize("NFD", word.lower())
                           if unicodedata.category(c) != "Mn")
        current = None
        for c in word:
            if _is_punctuation(c):
                words.append(c)
                current = None
            elif current is None:
                current = [c]
                words.append(current)
            else:
                current.append(c)
    return " ".join(w if isinstance(w, str) else "".join(w) for w in words).split()


def wordpiece(word: str, vocab: dict[str, int], unk: str = "[UNK]") -> list[str]:
    if len(word) > MAX_WORD_CHARS:
        return [unk]
    pieces, start = [], 0
    while start < len(word):
        end = len(word)
        while end > start:
            piece = word[start:end] if start == 0 else "##" + word[start:end]
            if piece in vocab:
                break
            end -= 1
        if end == start:
            return [unk]
        pieces.append(piece)
        start = end
    return pieces


class BertWordPieceTokenizer(Tokenizer):
    def __init__(self, vocab_file: str | None, lower_case: bool = True, vocab_extra_ids: int = 0):
        self.name = "BertWordPieceLowerCase" if lower_case else "BertWordPieceCase"
        need_file(vocab_file, "--vocab-file", self.name, "BERT vocab.txt (one token a line)")
        self.lower_case, self.vocab = lower_case, read_vocab(vocab_file)
        missing = [t for t in BERT_SPECIALS if t not in self.vocab]
        if missing:
            raise DataError(f"{vocab_file}: no {' '.join(missing)} line: --vocab-file of "
                            f"{self.name} must be a BERT vocabulary with {' '.join(BERT_SPECIALS)}")
        self.inv_vocab = {i: t for t, i in self.vocab.items()}
        for token in ("[BOS]", "[EOS]", *(f"<extra_id_{i}>" for i in range(vocab_extra_ids))):
            if token not in self.vocab:
                self.inv_vocab[len(self.vocab)] = token
                self.vocab[token] = len(self.vocab)
        v = self.vocab
        self._cls_id, self._sep_id, self._pad_id = v["[CLS]"], v["[SEP]"], v["[PAD]"]
        self._mask_id, self._bos_id = v["[MASK]"], v["[BOS]"]
        self._eos_id = self._eod_id = v["[EOS]"]
        self.special_ids = tuple(sorted({self._cls_id, self._sep_id, self._pad_id,
                                         self._mask_id, self._bos_id, self._eos_id}))
        self.source = f"--vocab-file {vocab_file}"

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def tokenize(self, text: str) -> list[int]:
        return [self.vocab[p] for w in basic_tokenize(text, self.lower_case)
                for p in wordpiece(w, self.vocab)]

    def detokenize(self, ids) -> str:
        """Megatron's convert_tokens_to_string: pieces joined by spaces, " ##" removed."""
        return " ".join(self.inv_vocab[int(i)] for i in ids).replace(" ##", "").strip()
