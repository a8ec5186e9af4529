"""HuggingFace model directories: the converters' HF reader and writer.

    export_hf(model, out_dir)   FullModel -> out_dir/config.json + model.safetensors (+ tokenizer)
    import_hf(hf_dir)           hf_dir -> FullModel (GPT2LMHeadModel or LlamaForCausalLM)

Needs the `hf` extra (`pip install .[hf]`: transformers, safetensors), imported only here and
only when called, so the rest of the package works without it. Nothing is downloaded: the
directories are local and HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE are set before transformers
loads. A sentencepiece tokenizer travels with the weights as `tokenizer.model` (tokenizers.py).
"""
from __future__ import annotations

import json
import os
from dataclasses import replace

import torch

from megatron_2bw.checkpoint.convert.hf_import import from_hf, model_config
from megatron_2bw.checkpoint.convert.hf_mapping import (ConvertError, hf_class, hf_config_kwargs,
                                                        to_hf)
from megatron_2bw.checkpoint.convert.native import FullModel
from megatron_2bw.config import Config
from megatron_2bw.data.tokenizer import vocab_size_with_padding


def require_hf():
    """Import transformers and safetensors offline, or one line saying how to install them."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import safetensors.torch  # noqa: F401
        import transformers
    except ImportError as e:
        raise ConvertError(f"HuggingFace conversion needs the hf extra ({e.name} is not "
                           "installed): pip install .[hf]") from None
    return transformers


def _config_class(kind: str):
    transformers = require_hf()
    return {"GPT2LMHeadModel": transformers.GPT2Config,
            "LlamaForCausalLM": transformers.LlamaConfig}[kind]


def export_hf(model: FullModel, out_dir: str, vocab_size: int | None = None,
              eod: int | None = None) -> str:
    """Write `model` as a HuggingFace directory (refuses a non-empty one); returns its class.
    `vocab_size` cuts the padded vocabulary (Megatron's --true-vocab-size)."""
    m = model.config.model
    kind = hf_class(m)
    require_hf()
    from safetensors.torch import save_file
    V = vocab_size or m.vocab_size
    if not 1 <= V <= m.vocab_size:
        raise ConvertError(f"--vocab-size {V} must be in 1..{m.vocab_size} (the model's padded "
                           "vocabulary)")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise ConvertError(f"{out_dir} is not empty: export into a new directory")
    tensors = to_hf(m, model.state, V)
    config = _config_class(kind)(**hf_config_kwargs(m, V, eod))
    os.makedirs(out_dir, exist_ok=True)
    config.save_pretrained(out_dir)
    save_file({k: v.float().contiguous() for k, v in tensors.items()},
              os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return kind


def read_hf_tensors(hf_dir: str) -> dict[str, torch.Tensor]:
    """All tensors of a HuggingFace directory: model.safetensors, its sharded form
    (model.safetensors.index.json) or pytorch_model.bin."""
    single = os.path.join(hf_dir, "model.safetensors")
    index = single + ".index.json"
    if os.path.exists(single) or os.path.exists(index):
        require_hf()
        from safetensors.torch import load_file
        if os.path.exists(single):
            return load_file(single)
        files = sorted(set(json.load(open(index))["weight_map"].values()))
        out = {}
        for name in files:
            out.update(load_file(os.path.join(hf_dir, name)))
        return out
    binary = os.path.join(hf_dir, "pytorch_model.bin")
    if os.path.exists(binary):
        return torch.load(binary, map_location="cpu", weights_only=True)
    raise ConvertError(f"{hf_dir} holds no weights (model.safetensors, "
                       "model.safetensors.index.json or pytorch_model.bin)")


def read_hf_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise ConvertError(f"{hf_dir} is not a HuggingFace model directory (no config.json)")
    try:
        return json.load(open(path))
    except json.JSONDecodeError as e:
        raise ConvertError(f"{path} is not valid JSON ({e.msg}, line {e.lineno})") from None


def import_hf(hf_dir: str, tensor: int = 1, divisible_by: int = 128,
              base: Config | None = None) -> FullModel:
    """The FullModel of a HuggingFace directory, its vocabulary padded as the data pipeline pads
    a tokenizer's for tensor size `tensor` (--make-vocab-size-divisible-by). `base` gives the
    non-model settings (defaults: Config())."""
    hf = read_hf_config(hf_dir)
    kind, m = model_config(hf)
    m = replace(m, vocab_size=vocab_size_with_padding(hf["vocab_size"], divisible_by, tensor))
    state = from_hf(kind, m, read_hf_tensors(hf_dir))
    return FullModel(replace(base or Config(), model=m), state, 0)


def hf_vocab_size(hf_dir: str) -> int:
    return int(read_hf_config(hf_dir)["vocab_size"])
