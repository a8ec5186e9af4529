"""HuggingFace model directories: the converters' HF reader and writer.

    export_hf(model, out_dir)   FullModel -> out_dir/config.json + model.safetensors (+ tokenizer)
    import_hf(hf_dir)           hf_dir -> FullModel (GPT2LMHeadModel or LlamaForCausalLM)

Needs the `hf` extra (`pip install .[hf]`: transformers, safetensors), imported only here and
only when called, so the rest of the package works without it. Nothing is downloaded: the
directories are local and HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE are set before transformers
loads. A sentencepiece tokenizer travels with the weights as `tokenizer.model` (tokenizers.py).
"""
from __future__ import annotations

import os
from dataclasses import replace

import torch

from megatron_2bw.checkpoint.convert.hf_import import (CONFIG_FIX, check_hf_config, from_hf,
                                                       model_config)
from megatron_2bw.checkpoint.convert.hf_mapping import (ConvertError, hf_class, hf_config_kwargs,
                                                        to_hf)
from megatron_2bw.checkpoint.convert.native import FullModel
from megatron_2bw.config import Config
from megatron_2bw.config.input_files import json_kind, read_json
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


WEIGHTS_FIX = "pass a HuggingFace model directory as save_pretrained writes it"


def _load_safetensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    if not os.path.isfile(path):
        raise ConvertError(f"{path}: no such file (named in model.safetensors.index.json); "
                           f"{WEIGHTS_FIX}")
    try:
        return load_file(path)
    except Exception as e:  # noqa: BLE001 - safetensors' errors on a damaged file vary
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise ConvertError(f"{path}: not a safetensors file ({first}: damaged, cut short or "
                           f"another format); {WEIGHTS_FIX}") from None


def read_hf_tensors(hf_dir: str) -> dict[str, torch.Tensor]:
    """All tensors of a HuggingFace directory: model.safetensors, its sharded form
    (model.safetensors.index.json) or pytorch_model.bin, each read inside a one-line error."""
    single = os.path.join(hf_dir, "model.safetensors")
    index = single + ".index.json"
    if os.path.exists(single) or os.path.exists(index):
        require_hf()
        if os.path.exists(single):
            return _load_safetensors(single)
        weight_map = read_json(index, WEIGHTS_FIX, dict, ConvertError).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map or not all(
                isinstance(f, str) for f in weight_map.values()):
            raise ConvertError(f"{index}: its weight_map is {json_kind(weight_map)}, not an "
                               f"object tensor name -> file name; {WEIGHTS_FIX}")
        out = {}
        for name in sorted(set(weight_map.values())):
            out.update(_load_safetensors(os.path.join(hf_dir, name)))
        return out
    binary = os.path.join(hf_dir, "pytorch_model.bin")
    if os.path.exists(binary):
        try:
            state = torch.load(binary, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - unpickling a damaged file fails in many ways
            raise ConvertError(f"{binary}: not a torch state dict ({type(e).__name__}: damaged, "
                               f"cut short or another format); {WEIGHTS_FIX}") from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor)
                                                  for v in state.values()):
            raise ConvertError(f"{binary}: not a state dict of tensors; {WEIGHTS_FIX}")
        return state
    raise ConvertError(f"{hf_dir} holds no weights (model.safetensors, "
                       "model.safetensors.index.json or pytorch_model.bin)")


def read_hf_config(hf_dir: str) -> dict:
    """config.json, read and its fields typed (hf_import.check_hf_config)."""
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise ConvertError(f"{hf_dir} is not a HuggingFace model directory (no config.json)")
    return check_hf_config(read_json(path, CONFIG_FIX, dict, ConvertError), path)


def import_hf(hf_dir: str, tensor: int = 1, divisible_by: int = 128,
              base: Config | None = None) -> FullModel:
    """The FullModel of a HuggingFace directory, its vocabulary padded as the data pipeline pads
    a tokenizer's for tensor size `tensor` (--make-vocab-size-divisible-by). `base` gives the
    non-model settings (defaults: Config())."""
    hf = read_hf_config(hf_dir)
    kind, m = model_config(hf)
    m = replace(m, vocab_size=vocab_size_with_padding(hf["vocab_size"], divisible_by, tensor))
    tensors = read_hf_tensors(hf_dir)
    try:
        state = from_hf(kind, m, tensors)
    except RuntimeError as e:  # a view or stack of tensors whose shapes config.json contradicts
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        raise ConvertError(f"{hf_dir}: the weights do not have the shapes config.json gives "
                           f"them ({first}); {WEIGHTS_FIX}") from None
    return FullModel(replace(base or Config(), model=m), state, 0)


def hf_vocab_size(hf_dir: str) -> int:
    return int(read_hf_config(hf_dir)["vocab_size"])
