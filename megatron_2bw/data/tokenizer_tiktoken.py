"""Megatron's TikTokenizer (CustomTikTokenizer): tiktoken's rank BPE from `--tokenizer-model`,
with the ids Megatron-LM gives.

- the file: Megatron's JSON list of {"rank": i, "token_bytes": base64, "token_str": ...} with
  rank i at position i (the 256 single bytes first), or tiktoken's own "base64 rank" lines;
- ids: the first `--tiktoken-num-special-tokens` N ids (default 1000) are the special tokens
  <unk> <s> </s> (or `--tokenizer-special-tokens`, which must include those three) then
  <SPECIAL_k> fillers up to N; the file's token of rank r is id N + r, for the first
  `--vocab-size` - N ranks (vocab_size default 2^17, as Megatron's);
- text is cut by `--tiktoken-pattern` v1 or v2 and encoded as plain text (a special token's
  string is not special in the text); bos <s> = 1 and eod = eos </s> = 2 are added by callers.
Needs the tiktoken package (an optional extra; a one-line error names it when absent).
"""
from __future__ import annotations

import base64
import binascii
import os

from megatron_2bw.config.input_files import file_error, json_kind, parse_json, read_text
from megatron_2bw.data.errors import DataError
from megatron_2bw.data.tokenizer_base import Tokenizer, need_file, need_package

PATTERN_V1 = (r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|"
              r"\s+(?!\S)|\s+")
PATTERN_V2 = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
              r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|"
              r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PATTERNS = {"v1": PATTERN_V1, "v2": PATTERN_V2}
REQUIRED_SPECIALS = ("<unk>", "<s>", "</s>")
DEFAULT_VOCAB_SIZE = 2 ** 17
NAME = "TikTokenizer"


RANKS_FIX = ("pass Megatron's tiktoken .json (a list of {\"rank\": i, \"token_bytes\": base64, "
             "\"token_str\": ...}, rank i at position i) or tiktoken's 'base64 rank' lines")


def _token(path: str, text, where: str) -> bytes:
    if not isinstance(text, str):
        raise file_error(path, f"{where}: token_bytes is {json_kind(text)}, not base64 text",
                         RANKS_FIX, DataError)
    try:
        return base64.b64decode(text)
    except (binascii.Error, ValueError):
        raise file_error(path, f"{where}: {text[:20]!r} is not base64", RANKS_FIX,
                         DataError) from None


def read_ranks(path: str, max_vocab: int) -> dict[bytes, int]:
    """token bytes -> rank for the ranks below max_vocab, checked as Megatron checks them."""
    bad = "not a tiktoken vocabulary"
    text = read_text(path, RANKS_FIX, DataError)
    pairs = []
    if path.endswith(".json"):
        entries = parse_json(path, text, RANKS_FIX, DataError)
        if not isinstance(entries, list):
            raise file_error(path, f"{json_kind(entries)} where a JSON list [...] belongs",
                             RANKS_FIX, DataError)
        for i, e in enumerate(entries):
            if not isinstance(e, dict) or e.get("rank") != i:
                raise file_error(path, f"entry {i} is not {{\"rank\": {i}, ...}} (rank i at "
                                       "position i)", RANKS_FIX, DataError)
            pairs.append((_token(path, e.get("token_bytes"), f"entry {i}"), i))
    else:
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            parts = line.split()
            if len(parts) != 2 or not parts[1].isdigit():
                raise file_error(path, f"line {n} ({line.strip()[:40]!r}) is not 'BASE64 RANK'",
                                 RANKS_FIX, DataError)
            pairs.append((_token(path, parts[0], f"line {n}"), int(parts[1])))
    ranks = {tok: r for tok, r in pairs if r < max_vocab}
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise DataError(f"{path}: {bad}: its ranks must be 0..n-1, each token once")
    if path.endswith(".json") and any(ranks.get(bytes([b]), b) != b for b in range(256)):
        raise DataError(f"{path}: {bad}: Megatron's .json lists the 256 single bytes first, "
                        "in order")
    return ranks


class TikTokenizer(Tokenizer):
    name = NAME

    def __init__(self, path: str | None, pattern: str | None, vocab_size: int | None = None,
                 num_special_tokens: int = 1000, special_tokens: list[str] | None = None):
        need_file(path, "--tokenizer-model", NAME, "tiktoken vocabulary (.json)")
        if pattern not in PATTERNS:
            raise DataError(f"--tokenizer-type {NAME} needs --tiktoken-pattern v1 or v2 (got "
                            f"{pattern}): the pattern the vocabulary was trained with")
        tiktoken = need_package("tiktoken", NAME)
        vocab_size = vocab_size or DEFAULT_VOCAB_SIZE
        specials = list(special_tokens) if special_tokens else list(REQUIRED_SPECIALS)
        if len(set(specials)) != len(specials) or not set(REQUIRED_SPECIALS) <= set(specials):
            raise DataError(f"--tokenizer-special-tokens {' '.join(specials)}: give distinct "
                            "tokens that include <unk> <s> </s>")
        if not len(specials) <= num_special_tokens < vocab_size:
            raise DataError(f"--tiktoken-num-special-tokens {num_special_tokens}: must be at "
                            f"least the {len(specials)} special tokens and below --vocab-size "
                            f"{vocab_size}")
        specials += [f"<SPECIAL_{i}>" for i in range(len(specials), num_special_tokens)]
        inner = vocab_size - num_special_tokens
        ranks = read_ranks(path, inner)
        if len(ranks) < inner:
            raise DataError(f"{path}: {len(ranks)} tokens, fewer than --vocab-size {vocab_size} "
                            f"- --tiktoken-num-special-tokens {num_special_tokens} = {inner}: "
                            f"pass --vocab-size {len(ranks) + num_special_tokens}")
        self._vocab_size = vocab_size
        self.special_tokens = {t: i for i, t in enumerate(specials)}
        self._unk_id = self.special_tokens["<unk>"]
        self._bos_id = self.special_tokens["<s>"]
        self._eos_id = self._eod_id = self.special_tokens["</s>"]
        self.model = tiktoken.Encoding(
            name=os.path.basename(os.path.dirname(os.path.abspath(path))) or NAME,
            pat_str=PATTERNS[pattern],
            mergeable_ranks={t: r + num_special_tokens for t, r in ranks.items()},
            special_tokens=self.special_tokens)
        self.special_ids = tuple(range(num_special_tokens))
        self.source = f"--tokenizer-model {path} --tiktoken-pattern {pattern}"

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def tokenize(self, text: str) -> list[int]:
        return self.model.encode_ordinary(text)

    def detokenize(self, ids) -> str:
        return self.model.decode([int(i) for i in ids])
