"""The tokenizer that travels with a checkpoint directory or a HuggingFace export.

A training run with --save records the tokenizer it trained with beside its checkpoints
(pretrain.py calls `record_tokenizer` once, on rank 0, before training):

    {save}/tokenizer_args.json   {"tokenizer_type": ..., ["vocab_size": N for the NullTokenizer]}
                                 (+ build_tokenizer's options: --vocab-file/--merge-file and
                                 the other tokenizer files as absolute paths, not copied)
    {save}/tokenizer.model       a copy of the sentencepiece model (sentencepiece types only)

so that `tools/generate.py` and the exporter find it even after the data's cache is gone.
A HuggingFace directory carries a sentencepiece tokenizer as `tokenizer.model` (plus a
`tokenizer_config.json` naming transformers' sentencepiece-based LlamaTokenizer, without added
bos/eos, so `AutoTokenizer` produces the same ids as training did).
"""
from __future__ import annotations

import json
import os

from megatron_2bw.checkpoint.files import write_checkpoint_file
from megatron_2bw.data.errors import DataError
from megatron_2bw.data.tokenizer import Tokenizer, build_tokenizer

TOKENIZER_MODEL = "tokenizer.model"
TOKENIZER_ARGS = "tokenizer_args.json"
SENTENCEPIECE = "GPTSentencePieceTokenizer"


def _copy(src: str, dst: str) -> None:
    data = open(src, "rb").read()
    write_checkpoint_file(dst, lambda f: f.write(data))


def record_tokenizer(directory: str, tokenizer: Tokenizer | None) -> None:
    """Keep `tokenizer` beside the checkpoints in `directory` (nothing for mock data)."""
    if tokenizer is None:
        return
    args = {"tokenizer_type": tokenizer.name}
    model_file = getattr(tokenizer, "model_file", None)
    built = dict(getattr(tokenizer, "build_args", {}))  # data/tokenizer.build_tokenizer's
    if model_file:
        _copy(model_file, os.path.join(directory, TOKENIZER_MODEL))
        built.pop("tokenizer_model", None)
        args.update(built)  # e.g. --vocab-extra-ids
    elif getattr(tokenizer, "source", None):  # vocab/merges files, an HF directory, tiktoken:
        args.update(built)                    # their absolute paths
    else:
        args["vocab_size"] = tokenizer.vocab_size - 1  # the NullTokenizer's --vocab-size
    write_checkpoint_file(os.path.join(directory, TOKENIZER_ARGS),
                          lambda f: f.write((json.dumps(args) + "\n").encode()))


def recorded_tokenizer(directory: str) -> Tokenizer | None:
    """The tokenizer recorded in a checkpoint directory or carried by a HuggingFace one."""
    args_path = os.path.join(directory, TOKENIZER_ARGS)
    model = os.path.join(directory, TOKENIZER_MODEL)
    if os.path.exists(args_path):
        args = json.load(open(args_path))
        ttype = args.pop("tokenizer_type")
        if os.path.exists(model):
            args["tokenizer_model"] = model
        return build_tokenizer(ttype, **args)
    if os.path.exists(model):
        return build_tokenizer(SENTENCEPIECE, model)
    return None


def eod_or_none(tokenizer: Tokenizer | None) -> int | None:
    """The end-of-document id, or None (no tokenizer, or a sentencepiece model without eos)."""
    try:
        return tokenizer.eod if tokenizer is not None else None
    except DataError:
        return None


def sentencepiece_flags(directory: str) -> list[str]:
    """The data flags that train with the sentencepiece model in `directory` (empty if none)."""
    model = os.path.join(directory, TOKENIZER_MODEL)
    if not os.path.exists(model):
        return []
    args_path = os.path.join(directory, TOKENIZER_ARGS)
    kind = json.load(open(args_path))["tokenizer_type"] if os.path.exists(args_path) \
        else SENTENCEPIECE
    return ["--tokenizer-type", kind, "--tokenizer-model", os.path.abspath(model)]


def carry_to_checkpoint(hf_dir: str, ckpt_dir: str) -> bool:
    """Import: copy a HuggingFace directory's sentencepiece model into the checkpoint."""
    model = os.path.join(hf_dir, TOKENIZER_MODEL)
    if not os.path.exists(model):
        return False
    build_tokenizer(SENTENCEPIECE, model)  # a one-line error if it is not sentencepiece
    _copy(model, os.path.join(ckpt_dir, TOKENIZER_MODEL))
    write_checkpoint_file(os.path.join(ckpt_dir, TOKENIZER_ARGS),
                          lambda f: f.write((json.dumps({"tokenizer_type": SENTENCEPIECE}) + "\n")
                                            .encode()))
    return True


def carry_to_hf(ckpt_dir: str, hf_dir: str) -> bool:
    """Export: give the HuggingFace directory the checkpoint's sentencepiece model."""
    model = os.path.join(ckpt_dir, TOKENIZER_MODEL)
    if not os.path.exists(model):
        return False
    _copy(model, os.path.join(hf_dir, TOKENIZER_MODEL))
    config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": False,
              "add_eos_token": False}
    write_checkpoint_file(os.path.join(hf_dir, "tokenizer_config.json"),
                          lambda f: f.write((json.dumps(config, indent=2) + "\n").encode()))
    return True
