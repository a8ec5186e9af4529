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
import json
import os

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


def read_ranks(path: str, max_vocab: int) -> dict[bytes, int]:
    """token bytes -> rank for the ranks below max_vocab, checked as Megatron checks them."""
    bad = f"{path}: not a tiktoken vocabulary"
    text = open(path, encoding="utf-8").read()
    try:
        if path.endswith(".json"):
            entries = json.loads(text)
            if not isinstance(entries, list) or not all(
                    isinstance(e, dict) and e.get("rank") == i for i, e in enumerate(entries)):
                raise DataError(f"{bad} (a JSON list of {{rank, token_bytes, token_str}} with "
                                "rank i at position i): pass Megatron's tiktoken .json")
            pairs = [(base64.b64decode(e["token_bytes"]), e["rank"]) for e in entries]
        else:
            pairs = [(base64.b64decode(tok), int(rank)) for tok, rank in
                     (line.split() for line in text.splitlines() if line.strip())]
    except (ValueError, KeyError, TypeError, binascii.Error) as e:
        raise DataError(f"{bad} ({type(e).__name__}): pass a .json list of {{rank, "
                        "token_bytes, token_str}} or tiktoken's 'base64 rank' lines") from None
    ranks = {tok: r for tok, r in pairs if r < max_vocab}
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise DataError(f"{bad}: its ranks must be 0..n-1, each token once")
    if path.endswith(".json") and any(ranks.get(bytes([b]), b) != b for b in range(256)):
        raise DataError(f"{bad}: Megatron's .json lists the 256 single bytes first, in order")
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
