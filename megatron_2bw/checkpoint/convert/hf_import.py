"""HuggingFace config + state dict -> our ModelConfig + full state (the inverse of hf_mapping.to_hf).

`model_config(hf)` reads a GPT-2 or Llama config (a dict: config.json as transformers writes it,
old and new RoPE keys alike) and refuses, in one line naming the reason, what our model cannot
compute exactly: another model type, another activation, scaled RoPE (llama3, linear, ...),
or biases on attention but not on the MLP (or the other
way round: `--disable-bias-linear` is all or nothing). `from_hf` maps the tensors (names and
layouts: hf_mapping.py) and pads the vocabulary with zero rows to `vocab_size`.
"""
from __future__ import annotations

import torch

from megatron_2bw.checkpoint.convert.hf_mapping import GPT2, LLAMA, ConvertError, _layer_names
from megatron_2bw.config import ModelConfig
from megatron_2bw.config.flavours import llama_architecture
from megatron_2bw.config.input_files import json_kind
from megatron_2bw.config.numbers import is_finite


CONFIG_FIX = ("pass a HuggingFace GPT-2 or Llama directory (config.json as save_pretrained "
              "writes it)")
_POSITIVE, _NUMBER, _BOOL, _TEXT, _OBJECT = ("a positive integer", "a finite number",
                                             "true or false", "a string", "an object")
# the config.json keys model_config reads, their kinds (null stands for absent), and the keys
# each model type needs
HF_FIELDS = {
    **dict.fromkeys(("vocab_size", "n_embd", "n_layer", "n_head", "n_positions", "n_inner",
                     "hidden_size", "num_attention_heads", "num_hidden_layers",
                     "intermediate_size", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"), _POSITIVE),
    **dict.fromkeys(("layer_norm_epsilon", "resid_pdrop", "attn_pdrop", "initializer_range",
                     "rope_theta", "rms_norm_eps", "attention_dropout"), _NUMBER),
    **dict.fromkeys(("scale_attn_by_inverse_layer_idx", "add_cross_attention",
                     "scale_attn_weights", "tie_word_embeddings", "attention_bias", "mlp_bias"),
                    _BOOL),
    **dict.fromkeys(("model_type", "activation_function", "hidden_act"), _TEXT),
    **dict.fromkeys(("rope_scaling", "rope_parameters"), _OBJECT),
}
HF_REQUIRED = {"gpt2": ("vocab_size", "n_embd", "n_layer", "n_head", "n_positions"),
               "llama": ("vocab_size", "hidden_size", "num_attention_heads", "num_hidden_layers",
                         "intermediate_size")}


def _is(kind: str, value) -> bool:
    if kind == _POSITIVE:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1
    if kind == _NUMBER:
        return is_finite(value)
    return isinstance(value, {_BOOL: bool, _TEXT: str, _OBJECT: dict}[kind])


def check_hf_config(hf: dict, where: str = "config.json") -> dict:
    """`hf` when every key model_config reads has its type and the model type's required keys
    are there; one-line ConvertError naming the file and the key otherwise."""
    for key in HF_REQUIRED.get(hf.get("model_type"), ()):
        if hf.get(key) is None:
            raise ConvertError(f"{where}: no {key} (a {hf['model_type']} config.json has it); "
                               f"{CONFIG_FIX}")
    for key, kind in HF_FIELDS.items():
        value = hf.get(key)
        if value is not None and not _is(kind, value):
            raise ConvertError(f"{where}: {key} is {json_kind(value)}, not {kind}; {CONFIG_FIX}")
    return hf


def _rope(hf: dict) -> tuple[float, str]:
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if not is_finite(theta):
        raise ConvertError(f"config.json: rope_theta is {json_kind(theta)}, not a finite number; "
                           f"{CONFIG_FIX}")
    return float(theta), kind


def model_config(hf: dict) -> tuple[str, ModelConfig]:
    """(HF class, our ModelConfig without the padded vocabulary) of a HuggingFace config."""
    check_hf_config(hf)
    kind = hf.get("model_type")
    if kind == "gpt2":
        act = hf.get("activation_function", "gelu_new")
        if act not in ("gelu", "gelu_new"):
            raise ConvertError(f"GPT-2 activation_function {act!r} cannot be imported: the model "
                               "computes gelu (erf) or gelu_new (--openai-gelu) only")
        for key in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
            if hf.get(key):
                raise ConvertError(f"GPT-2 with {key}=true cannot be imported: the model has "
                                   "no such variant")
        if hf.get("scale_attn_weights") is False:
            raise ConvertError("GPT-2 with scale_attn_weights=false cannot be imported: the "
                               "model always scales attention scores by 1/sqrt(head dim)")
        h = hf["n_embd"]
        return GPT2, ModelConfig(
            num_layers=hf["n_layer"], hidden_size=h, num_attention_heads=hf["n_head"],
            ffn_hidden_size=hf.get("n_inner") or 4 * h, seq_length=hf["n_positions"],
            max_position_embeddings=hf["n_positions"],
            layernorm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
            hidden_dropout=hf.get("resid_pdrop", 0.0), attention_dropout=hf.get("attn_pdrop", 0.0),
            init_method_std=hf.get("initializer_range", 0.02), openai_gelu=act == "gelu_new",
            untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", True))
    if kind == "llama":
        return LLAMA, _llama(hf)
    raise ConvertError(f"model_type {kind!r} cannot be imported: only gpt2 (GPT2LMHeadModel) and "
                       "llama (LlamaForCausalLM) map onto this model")


def _llama(hf: dict) -> ModelConfig:
    h, heads = hf["hidden_size"], hf["num_attention_heads"]
    groups = hf.get("num_key_value_heads") or heads
    if hf.get("hidden_act", "silu") != "silu":
        raise ConvertError(f"Llama hidden_act {hf['hidden_act']!r} cannot be imported: SwiGLU "
                           "here is SiLU-gated")
    theta, rope_type = _rope(hf)
    if rope_type != "default":
        raise ConvertError(f"Llama rope_type {rope_type!r} cannot be imported: the model "
                           "computes plain RoPE (no frequency scaling)")
    if bool(hf.get("attention_bias")) != bool(hf.get("mlp_bias")):
        raise ConvertError("Llama with attention_bias != mlp_bias cannot be imported: "
                           "--disable-bias-linear removes every linear bias or none")
    arch = llama_architecture(groups, theta)
    arch["group_query_attention"] = groups != heads
    arch["add_bias_linear"] = bool(hf.get("attention_bias"))
    head_dim = hf.get("head_dim") or h // heads
    arch["num_kv_channels"] = head_dim if head_dim != h // heads else None  # --kv-channels
    pos = hf.get("max_position_embeddings", 2048)
    return ModelConfig(num_layers=hf["num_hidden_layers"], hidden_size=h,
                       num_attention_heads=heads, ffn_hidden_size=hf["intermediate_size"],
                       seq_length=pos, max_position_embeddings=pos,
                       layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
                       attention_dropout=hf.get("attention_dropout", 0.0) or 0.0,
                       init_method_std=hf.get("initializer_range", 0.02),
                       untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings",
                                                                      False), **arch)


def _strip(tensors: dict, prefix: str) -> dict:
    """Drop the model prefix (GPT-2 hub files often have none) and non-parameter buffers."""
    out = {}
    for k, v in tensors.items():
        k = k[len(prefix):] if k.startswith(prefix) else k
        if k.endswith(("attn.bias", "attn.masked_bias", "rotary_emb.inv_freq")) and \
                not k.endswith("c_attn.bias"):
            continue
        out[k] = v
    return out


def _take(t: dict, name: str) -> torch.Tensor:
    if name not in t:
        raise ConvertError(f"the HuggingFace weights lack {name}: the directory is incomplete "
                           "or holds another model")
    return t.pop(name).float()


def from_hf(kind: str, m: ModelConfig, tensors: dict) -> dict[str, torch.Tensor]:
    """Our full state (one-process names) of HF `tensors`; m.vocab_size >= the HF vocabulary."""
    t = _strip(tensors, "transformer." if kind == GPT2 else "model.")
    lm_head = t.pop("lm_head.weight", None)
    word = _take(t, "wte.weight" if kind == GPT2 else "embed_tokens.weight")
    V, L = word.shape[0], m.num_layers
    if V > m.vocab_size:
        raise ConvertError(f"the HuggingFace vocabulary ({V}) exceeds the model's {m.vocab_size}")
    state = {"layers.0.word_embeddings.weight": _pad(word, m.vocab_size)}
    if kind == GPT2:
        state["layers.0.position_embeddings.weight"] = _take(t, "wpe.weight")
    for i in range(L):
        ours = f"layers.{i + 1}."
        for name, hf_name in _layer_names(kind, i).items():
            if hf_name in t:
                value = _take(t, hf_name)
                transposed = kind == GPT2 and name.endswith(".weight") and "layernorm" not in name
                state[ours + name] = value.t() if transposed else value
        state.update({ours + k: v for k, v in
                      (_attention_gpt2 if kind == GPT2 else _attention_llama)(m, t, i).items()})
        if kind == LLAMA:
            pre = f"layers.{i}.mlp."
            state[ours + "mlp.fc1.weight"] = torch.stack([_take(t, pre + "gate_proj.weight"),
                                                          _take(t, pre + "up_proj.weight")])
            if m.add_bias_linear:
                state[ours + "mlp.fc1.gate_bias"] = _take(t, pre + "gate_proj.bias")
                state[ours + "mlp.fc1.up_bias"] = _take(t, pre + "up_proj.bias")
    head = f"layers.{L + 1}."
    norm = "ln_f." if kind == GPT2 else "norm."
    state[head + "final_layernorm.weight"] = _take(t, norm + "weight")
    if kind == GPT2:
        state[head + "final_layernorm.bias"] = _take(t, norm + "bias")
    if m.untie_embeddings_and_output_weights:
        if lm_head is None:
            raise ConvertError("tie_word_embeddings is false but the weights lack lm_head.weight")
        state[head + "weight"] = _pad(lm_head.float(), m.vocab_size)
    if t:
        raise ConvertError(f"the HuggingFace weights hold {sorted(t)[0]}, which this model has "
                           "no place for")
    return state


def _pad(w: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])]) if rows > w.shape[0] \
        else w


def _attention_gpt2(m: ModelConfig, t: dict, i: int) -> dict:
    a, d, h = m.num_attention_heads, m.kv_channels, m.hidden_size
    w = _take(t, f"h.{i}.attn.c_attn.weight").t()           # [3h, h]: all q | all k | all v
    out = {"self_attention.qkv.weight": w.view(3, a, d, h).transpose(0, 1).reshape(3 * h, h)}
    b = _take(t, f"h.{i}.attn.c_attn.bias").view(3, a, d)  # the key bias b[1] is dropped
    out["self_attention.qv_bias"] = torch.stack([b[0], b[2]], dim=1)
    return out


def _attention_llama(m: ModelConfig, t: dict, i: int) -> dict:
    G, d, h = m.query_groups, m.kv_channels, m.hidden_size
    P = m.num_attention_heads // G
    pre = f"layers.{i}.self_attn."
    q = _take(t, pre + "q_proj.weight").view(G, P, d, h)
    k = _take(t, pre + "k_proj.weight").view(G, 1, d, h)
    v = _take(t, pre + "v_proj.weight").view(G, 1, d, h)
    out = {"self_attention.qkv.weight": torch.cat([q, k, v], dim=1).reshape(-1, h)}
    if m.add_bias_linear:
        k_bias = _take(t, pre + "k_proj.bias")
        if k_bias.abs().max() > 0:
            raise ConvertError(f"layer {i} has a non-zero k_proj.bias: with RoPE a key bias "
                               "changes the attention and this model keeps none")
        q_bias = _take(t, pre + "q_proj.bias").view(G, P, d)
        v_bias = _take(t, pre + "v_proj.bias").view(G, 1, d)
        out["self_attention.qv_bias"] = torch.cat([q_bias, v_bias], dim=1)
    return out
