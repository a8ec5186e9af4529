"""The tokenizer that travels with a checkpoint directory or a HuggingFace export.

A training run with --save records the tokenizer it trained with beside its checkpoints, with
its first save and atomically with it (pretrain.py takes `tokenizer_files` before any process
group; each save publishes them before `latest` moves, checkpoint/files.publish_latest, and a
file that holds these bytes already is left alone), so a run that is refused or fails before
its first save leaves --save as it was:

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

from megatron_2bw.checkpoint.files import write_beside, write_checkpoint_file
from megatron_2bw.config.input_files import file_error, json_kind, read_bytes, read_json
from megatron_2bw.data.errors import DataError
from megatron_2bw.data.tokenizer import TOKENIZER_TYPES, Tokenizer, build_tokenizer

TOKENIZER_MODEL = "tokenizer.model"
TOKENIZER_ARGS = "tokenizer_args.json"
SENTENCEPIECE = "GPTSentencePieceTokenizer"


def _copy(src: str, dst: str) -> None:
    data = open(src, "rb").read()
    write_checkpoint_file(dst, lambda f: f.write(data))


def tokenizer_files(tokenizer: Tokenizer | None) -> dict[str, bytes]:
    """The files that record `tokenizer` beside the checkpoints, name -> bytes, the model before
    the arguments that name it (none for mock data); reads the sentencepiece model, writes
    nothing."""
    if tokenizer is None:
        return {}
    args, files = {"tokenizer_type": tokenizer.name}, {}
    model_file = getattr(tokenizer, "model_file", None)
    built = dict(getattr(tokenizer, "build_args", {}))  # data/tokenizer.build_tokenizer's
    if model_file:
        files[TOKENIZER_MODEL] = read_bytes(model_file, "give --tokenizer-model a readable "
                                            "sentencepiece model", DataError)
        built.pop("tokenizer_model", None)
        args.update(built)  # e.g. --vocab-extra-ids
    elif getattr(tokenizer, "source", None):  # vocab/merges files, an HF directory, tiktoken:
        args.update(built)                    # their absolute paths
    else:
        args["vocab_size"] = tokenizer.vocab_size - 1  # the NullTokenizer's --vocab-size
    files[TOKENIZER_ARGS] = (json.dumps(args) + "\n").encode()
    return files


def record_tokenizer(directory: str, tokenizer: Tokenizer | None) -> None:
    """Keep `tokenizer` beside the checkpoints in `directory` now (a save publishes
    `tokenizer_files` itself)."""
    write_beside(directory, tokenizer_files(tokenizer))


# tokenizer_args.json's keys besides tokenizer_type: build_tokenizer's arguments and their types
_ARG_TYPES = {"tokenizer_model": str, "vocab_size": int, "vocab_file": str, "merge_file": str,
              "vocab_extra_ids": int, "tiktoken_pattern": str, "tiktoken_num_special_tokens": int,
              "tokenizer_special_tokens": list, "trust_remote_code": bool}
_ARGS_FIX = ("it is written by pretrain with --save: remove it and give tools/generate.py "
             "--tokenizer-type (and --tokenizer-model) instead")


def read_tokenizer_args(path: str) -> dict:
    """tokenizer_args.json, checked: {"tokenizer_type": one of TOKENIZER_TYPES, build_tokenizer's
    arguments of their types}; one line naming the file otherwise."""
    args = read_json(path, _ARGS_FIX, dict, DataError)
    kind = args.get("tokenizer_type")
    if kind not in TOKENIZER_TYPES:
        raise file_error(path, f"tokenizer_type is {json_kind(kind)}, not one of "
                               f"{', '.join(TOKENIZER_TYPES)}", _ARGS_FIX, DataError)
    for key, value in args.items():
        want = _ARG_TYPES.get(key)
        if key == "tokenizer_type" or value is None and want is not None:
            continue
        if want is None:
            raise file_error(path, f"unknown key {json.dumps(key)}", _ARGS_FIX, DataError)
        if not isinstance(value, want) or (want is int and isinstance(value, bool)) or (
                want is list and not all(isinstance(t, str) for t in value)):
            what = {str: "a string", int: "an integer", bool: "true or false",
                    list: "a list of strings"}[want]
            raise file_error(path, f"{key} is {json_kind(value)}, not {what}", _ARGS_FIX,
                             DataError)
    return args


def recorded_tokenizer(directory: str) -> Tokenizer | None:
    """The tokenizer recorded in a checkpoint directory or carried by a HuggingFace one."""
    args_path = os.path.join(directory, TOKENIZER_ARGS)
    model = os.path.join(directory, TOKENIZER_MODEL)
    if os.path.exists(args_path):
        args = read_tokenizer_args(args_path)
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
    kind = read_tokenizer_args(args_path)["tokenizer_type"] if os.path.exists(args_path) \
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
