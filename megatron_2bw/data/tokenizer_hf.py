"""Megatron's HuggingFaceTokenizer: transformers' AutoTokenizer on a LOCAL directory
(`--tokenizer-model DIR` with tokenizer.json / tokenizer_config.json / vocab files; nothing is
downloaded), with the ids Megatron-LM gives: tokenize(text) = tokenizer(text).input_ids (the
special tokens the tokenizer adds by itself included), vocab_size = len(tokenizer) (added
tokens included), eod = the eos token, bos and pad the tokenizer's.
Needs the transformers package (the `hf` extra; a one-line error names it when absent).
"""
from __future__ import annotations

import os

from megatron_2bw.config.input_files import read_json
from megatron_2bw.data.errors import DataError
from megatron_2bw.data.tokenizer_base import Tokenizer, need_package

NAME = "HuggingFaceTokenizer"
# the JSON files AutoTokenizer reads from a directory (each a JSON object)
JSON_FILES = ("tokenizer_config.json", "tokenizer.json", "special_tokens_map.json",
              "added_tokens.json", "config.json", "vocab.json")


class HuggingFaceTokenizer(Tokenizer):
    name = NAME

    def __init__(self, directory: str | None, trust_remote_code: bool = False):
        if not directory:
            raise DataError(f"--tokenizer-type {NAME} needs --tokenizer-model DIR (a local "
                            "directory with the tokenizer's files)")
        if not os.path.isdir(directory):
            raise DataError(f"{directory}: not a directory (--tokenizer-model of {NAME}): pass "
                            "a local directory with tokenizer.json or tokenizer_config.json; "
                            "hub names are not downloaded")
        transformers = need_package("transformers", NAME)
        fix = "pass a directory saved by a tokenizer's save_pretrained"
        for name in JSON_FILES:  # read here first: a bad one is named, not a library's error
            if os.path.isfile(os.path.join(directory, name)):
                read_json(os.path.join(directory, name), fix, dict, DataError)
        try:
            self.hf = transformers.AutoTokenizer.from_pretrained(
                directory, local_files_only=True, trust_remote_code=trust_remote_code)
        except Exception as e:  # noqa: BLE001 - the library's errors on a bad directory vary
            first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            raise DataError(f"{directory}: transformers cannot load a tokenizer from it "
                            f"({first}); {fix}") from None
        self._eod_id = self._eos_id = self.hf.eos_token_id
        self._bos_id, self._pad_id = self.hf.bos_token_id, self.hf.pad_token_id
        self._cls_id, self._sep_id = self.hf.cls_token_id, self.hf.sep_token_id
        self._mask_id = self.hf.mask_token_id
        self.special_ids = tuple(sorted(set(self.hf.all_special_ids)))
        self.source = f"--tokenizer-model {directory}"

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def tokenize(self, text: str) -> list[int]:
        return list(self.hf(text).input_ids)

    def detokenize(self, ids) -> str:
        return self.hf.decode([int(i) for i in ids])
