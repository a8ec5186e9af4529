"""The tokenizer interface every `--tokenizer-type` implements (Megatron's names).

vocab_size, tokenize(text) -> ids, detokenize(ids) -> text, and the special ids eod, pad,
bos, eos, cls, sep, mask (a one-line DataError for one the tokenizer does not have).
`source` says which files it was built from (for error lines), None for the NullTokenizer.
"""
from __future__ import annotations

import importlib
import os

from megatron_2bw.data.errors import DataError


class Tokenizer:
    """Common interface: vocab_size, tokenize(text) -> ids, detokenize(ids) -> text, eod, ..."""
    name = "Tokenizer"
    _eod_id = _pad_id = _bos_id = _eos_id = _cls_id = _sep_id = _mask_id = None
    special_ids: tuple = ()
    source: str | None = None

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    def detokenize(self, ids) -> str:
        raise NotImplementedError

    def _need(self, value, what):
        if value is None or value < 0:
            raise DataError(f"the {self.name} has no {what} token: use a tokenizer that has one "
                            "(BERT needs [CLS]/[SEP]/[MASK]/pad: SentencePieceTokenizer, "
                            "BertWordPieceLowerCase or BertWordPieceCase)")
        return value

    eod = property(lambda self: self._need(self._eod_id, "eod"))
    pad = property(lambda self: self._need(self._pad_id, "pad"))
    bos = property(lambda self: self._need(self._bos_id, "bos"))
    eos = property(lambda self: self._need(self._eos_id, "eos"))
    cls = property(lambda self: self._need(self._cls_id, "cls"))
    sep = property(lambda self: self._need(self._sep_id, "sep"))
    mask = property(lambda self: self._need(self._mask_id, "mask"))


def need_file(path: str | None, flag: str, tokenizer_type: str, what: str) -> str:
    """`path` if it names an existing file, else a one-line DataError naming `flag`."""
    if not path:
        raise DataError(f"--tokenizer-type {tokenizer_type} needs {flag} ({what})")
    if not os.path.isfile(path):
        raise DataError(f"{path}: not found ({flag} of --tokenizer-type {tokenizer_type}): pass "
                        f"an existing {what}")
    return path


def need_package(module: str, tokenizer_type: str, package: str | None = None):
    """Import an optional extra, or a one-line DataError naming the pip package."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"--tokenizer-type {tokenizer_type} needs the {package or module} "
                        f"package: pip install {package or module}") from None
