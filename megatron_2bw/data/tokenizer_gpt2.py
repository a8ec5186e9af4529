"""Megatron's GPT2BPETokenizer: byte-level BPE from `--vocab-file` vocab.json and
`--merge-file` merges.txt, with the ids Megatron-LM's gpt2_tokenization gives.

- text is cut by GPT-2's pattern (contractions, letters, numbers, other, whitespace), each
  piece's UTF-8 bytes mapped to GPT-2's printable byte alphabet, then merged pair by pair,
  lowest merge rank first, until no listed pair is left;
- merges.txt: the first line (the "#version" header) and the last piece after the final
  newline are skipped, as Megatron reads it; a piece missing from vocab.json gets id 0;
- eod (and eos) = the id of <|endoftext|>; vocab_size = the entries of vocab.json.
"""
from __future__ import annotations

import json
from functools import lru_cache

from megatron_2bw.config.input_files import (file_error, is_json_document, json_kind, read_json,
                                             read_text)
from megatron_2bw.data.errors import DataError
from megatron_2bw.data.tokenizer_base import Tokenizer, need_file, need_package

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOD_TOKEN = "<|endoftext|>"


@lru_cache(maxsize=1)
def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> character map: printable Latin-1 bytes stand for
    themselves, the other 68 bytes take the characters from U+0100 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
            *range(ord("\xae"), ord("\xff") + 1)]
    table, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def bpe_merge(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """Merge the characters of `word`: repeatedly join every occurrence (left to right) of
    the adjacent pair with the lowest rank, until no adjacent pair has one."""
    parts = list(word)
    while len(parts) > 1:
        pairs = {(a, b) for a, b in zip(parts, parts[1:])}
        best = min(pairs, key=lambda p: ranks.get(p, float("inf")))
        if best not in ranks:
            break
        merged, i = [], 0
        while i < len(parts):
            if i < len(parts) - 1 and parts[i] == best[0] and parts[i + 1] == best[1]:
                merged.append(best[0] + best[1])
                i += 2
            else:
                merged.append(parts[i])
                i += 1
        parts = merged
    return parts


VOCAB_FIX = ("--vocab-file must be GPT-2's vocab.json (a JSON object token -> integer id, with "
             f"{EOD_TOKEN})")
MERGES_FIX = ("--merge-file must be GPT-2's merges.txt (a #version line, then one merge a line: "
              "two tokens and a space)")


def read_encoder(path: str) -> dict[str, int]:
    """vocab.json, checked: an object of integer ids >= 0 with <|endoftext|>."""
    encoder = read_json(path, VOCAB_FIX, dict, DataError)
    for token, i in encoder.items():
        if not isinstance(i, int) or isinstance(i, bool) or i < 0:
            raise file_error(path, f"the id of {json.dumps(token)} is {json_kind(i)}, not an "
                                   "integer >= 0", VOCAB_FIX, DataError)
    if EOD_TOKEN not in encoder:
        raise file_error(path, f"no {EOD_TOKEN} entry", VOCAB_FIX, DataError)
    return encoder


def read_merges(path: str) -> dict[tuple[str, str], int]:
    """merges.txt as Megatron reads it (the first line and the piece after the last newline
    skipped; a #version line alone is a BPE without merges); a line that is not two tokens, a
    JSON file, or a file without one whole line (empty or cut short): one line."""
    text = read_text(path, MERGES_FIX, DataError)
    if "\n" not in text:
        raise file_error(path, "not one whole line (empty, or cut short inside its first line)",
                         MERGES_FIX, DataError)
    if is_json_document(text):
        raise file_error(path, "a JSON document, not a list of merges", MERGES_FIX, DataError)
    merges = []
    for n, line in enumerate(text.split("\n")[1:-1], 2):
        pair = tuple(line.split())
        if not pair:
            continue  # a blank line merges nothing (the ranks keep their order)
        if len(pair) != 2:
            raise file_error(path, f"line {n} ({line.strip()[:40]!r}) is not a merge of two "
                                   "tokens", MERGES_FIX, DataError)
        merges.append(pair)
    return dict(zip(merges, range(len(merges))))


class GPT2BPETokenizer(Tokenizer):
    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str | None, merge_file: str | None):
        need_file(vocab_file, "--vocab-file", self.name, "GPT-2 vocab.json")
        need_file(merge_file, "--merge-file", self.name, "GPT-2 merges.txt")
        regex = need_package("regex", self.name)
        self.encoder = read_encoder(vocab_file)
        self.decoder = {v: k for k, v in self.encoder.items()}
        self.ranks = read_merges(merge_file)
        self.pattern = regex.compile(GPT2_PATTERN)
        self.byte_encoder = byte_alphabet()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        self._eod_id = self._eos_id = self.encoder[EOD_TOKEN]
        self.source = f"--vocab-file {vocab_file} --merge-file {merge_file}"
        self._cache: dict[str, list[int]] = {}

    @property
    def vocab_size(self) -> int:
        return len(self.encoder)

    def _piece_ids(self, piece: str) -> list[int]:
        ids = self._cache.get(piece)
        if ids is None:
            word = "".join(self.byte_encoder[b] for b in piece.encode("utf-8"))
            ids = [self.encoder.get(p, 0) for p in bpe_merge(word, self.ranks)]
            if len(self._cache) < 1 << 16:
                self._cache[piece] = ids
        return ids

    def tokenize(self, text: str) -> list[int]:
        return [i for piece in self.pattern.findall(text) for i in self._piece_ids(piece)]

    def detokenize(self, ids) -> str:
        text = "".join(self.decoder[int(i)] for i in ids)
        return bytearray(self.byte_decoder[c] for c in text).decode("utf-8", errors="replace")
