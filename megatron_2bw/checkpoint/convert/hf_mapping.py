"""Our full state dict <-> HuggingFace `GPT2LMHeadModel` / `LlamaForCausalLM` state dicts.

Names (ours: the one-process model's; transformer layer i of L sits at spec index i + 1):

    ours  layers.<..>                      GPT-2  transformer.<..>        Llama  model.<..>
    0.word_embeddings.weight               wte.weight                     embed_tokens.weight
    0.position_embeddings.weight           wpe.weight                     (RoPE: none)
    i+1.input_layernorm.*                  h.i.ln_1.*                     layers.i.input_layernorm.*
    i+1.self_attention.qkv.weight          h.i.attn.c_attn.weight         ..self_attn.{q,k,v}_proj.weight
    i+1.self_attention.qv_bias             h.i.attn.c_attn.bias           ..self_attn.{q,k,v}_proj.bias
    i+1.self_attention.proj.*              h.i.attn.c_proj.*              ..self_attn.o_proj.*
    i+1.post_attention_layernorm.*         h.i.ln_2.*                     ..post_attention_layernorm.*
    i+1.mlp.fc1.weight [f,h] / [2,f,h]     h.i.mlp.c_fc.weight            ..mlp.gate_proj, up_proj .weight
    i+1.mlp.fc1.bias / gate_bias, up_bias  h.i.mlp.c_fc.bias              ..mlp.gate_proj, up_proj .bias
    i+1.mlp.fc2.*                          h.i.mlp.c_proj.*               ..mlp.down_proj.*
    L+1.final_layernorm.*                  ln_f.*                         norm.*
    L+1.weight (untied only)               lm_head.weight (no prefix)     lm_head.weight (no prefix)

Layouts: GPT-2's Conv1D weights are [in, out] (ours [out, in]); its c_attn columns are
[all q | all k | all v] while ours are per head [q, k, v]; Llama's q/k/v projections are separate,
heads in order, while ours are grouped [q_1 .. q_P, k, v] per key/value group (models/
attention.py). Both sides rotate halves with RoPE, so q/k need no permutation. We keep no key
bias (softmax ignores it without RoPE): export writes zeros, import drops GPT-2's and refuses a
non-zero Llama one (with RoPE it would matter). A model without linear biases exports to GPT-2
with zero biases. Padded vocabulary rows (Megatron's padding) are zero on import.

Megatron's architecture flags: --apply-layernorm-1p stores gamma - 1, so export writes weight + 1
(HF's norms multiply by the weight itself); --kv-channels is Llama's head_dim (GPT-2's heads are
always n_embd / n_head wide: refused there); --qk-layernorm has no field in either class: refused.
"""
from __future__ import annotations

import torch

from megatron_2bw.config import ConfigError, ModelConfig


class ConvertError(ConfigError):
    """A model that cannot be converted; the message names the reason."""


GPT2, LLAMA = "GPT2LMHeadModel", "LlamaForCausalLM"


def hf_class(m: ModelConfig) -> str:
    """The HuggingFace class that computes exactly what `m` computes, or ConvertError."""
    if m.family != "gpt":
        raise ConvertError("BERT checkpoints cannot be exported: Megatron's BERT is pre-LayerNorm "
                           "and its binary head has no HuggingFace counterpart (HF BERT is "
                           "post-LayerNorm)")
    if m.qk_layernorm:
        raise ConvertError(f"--qk-layernorm cannot be exported: neither {GPT2} nor {LLAMA} has a "
                           "norm over each query and key head")
    gpt2 = (m.position_embedding_type == "learned_absolute", m.normalization == "LayerNorm",
            not m.swiglu, m.query_groups == m.num_attention_heads)
    if all(gpt2):
        if m.kv_channels * m.num_attention_heads != m.hidden_size:
            raise ConvertError(f"--kv-channels {m.kv_channels} cannot be exported: {GPT2}'s "
                               f"heads are n_embd / n_head = "
                               f"{m.hidden_size // m.num_attention_heads} channels wide")
        return GPT2
    llama = (m.position_embedding_type == "rope", m.normalization == "RMSNorm", m.swiglu)
    if all(llama):
        if m.rotary_percent != 1.0:
            raise ConvertError(f"--rotary-percent {m.rotary_percent} cannot be exported: "
                               f"{LLAMA} rotates every channel of a head")
        return LLAMA
    have = (f"{m.position_embedding_type} positions, {m.normalization}, "
            f"{'SwiGLU' if m.swiglu else 'GeLU'}, {m.query_groups} key/value heads for "
            f"{m.num_attention_heads} query heads")
    raise ConvertError(f"this model ({have}) matches neither {GPT2} (learned_absolute, "
                       f"LayerNorm, GeLU, one key/value head per head) nor {LLAMA} (rope, "
                       "RMSNorm, SwiGLU): no HuggingFace class computes it")


def hf_config_kwargs(m: ModelConfig, vocab_size: int, eod: int | None) -> dict:
    """Keyword arguments of the HuggingFace config class `hf_class(m)` names."""
    common = {"vocab_size": vocab_size, "tie_word_embeddings":
              not m.untie_embeddings_and_output_weights, "initializer_range": m.init_method_std,
              "bos_token_id": eod, "eos_token_id": eod, "architectures": [hf_class(m)]}
    if hf_class(m) == GPT2:
        return dict(common, model_type="gpt2", n_embd=m.hidden_size, n_layer=m.num_layers,
                    n_head=m.num_attention_heads, n_inner=m.ffn_size, n_positions=m.max_positions,
                    activation_function="gelu_new" if m.openai_gelu else "gelu",
                    layer_norm_epsilon=m.layernorm_epsilon, resid_pdrop=m.hidden_dropout,
                    embd_pdrop=m.hidden_dropout, attn_pdrop=m.attention_dropout)
    return dict(common, model_type="llama", hidden_size=m.hidden_size,
                intermediate_size=m.ffn_size, num_hidden_layers=m.num_layers,
                num_attention_heads=m.num_attention_heads, num_key_value_heads=m.query_groups,
                head_dim=m.kv_channels, hidden_act="silu",
                max_position_embeddings=m.max_positions, rms_norm_eps=m.layernorm_epsilon,
                rope_theta=float(m.rotary_base), attention_bias=m.add_bias_linear,
                mlp_bias=m.add_bias_linear, attention_dropout=m.attention_dropout)


def _layer_names(kind: str, i: int) -> dict[str, str]:
    """Our layer-local names -> HF names (without the transformer./model. prefix)."""
    if kind == GPT2:
        h = f"h.{i}."
        return {"input_layernorm.weight": h + "ln_1.weight", "input_layernorm.bias": h + "ln_1.bias",
                "self_attention.proj.weight": h + "attn.c_proj.weight",
                "self_attention.proj.bias": h + "attn.c_proj.bias",
                "post_attention_layernorm.weight": h + "ln_2.weight",
                "post_attention_layernorm.bias": h + "ln_2.bias",
                "mlp.fc1.weight": h + "mlp.c_fc.weight", "mlp.fc1.bias": h + "mlp.c_fc.bias",
                "mlp.fc2.weight": h + "mlp.c_proj.weight", "mlp.fc2.bias": h + "mlp.c_proj.bias"}
    h = f"layers.{i}."
    return {"input_layernorm.weight": h + "input_layernorm.weight",
            "self_attention.proj.weight": h + "self_attn.o_proj.weight",
            "self_attention.proj.bias": h + "self_attn.o_proj.bias",
            "post_attention_layernorm.weight": h + "post_attention_layernorm.weight",
            "mlp.fc2.weight": h + "mlp.down_proj.weight", "mlp.fc2.bias": h + "mlp.down_proj.bias"}


# GPT-2's Conv1D weights are stored [in, out]
_TRANSPOSED = ("attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight", "attn.c_attn.weight")


def to_hf(m: ModelConfig, state: dict, vocab_size: int | None = None) -> dict[str, torch.Tensor]:
    """HuggingFace state dict of our full state (vocabulary cut to `vocab_size` if given)."""
    kind, L = hf_class(m), m.num_layers
    prefix = "transformer." if kind == GPT2 else "model."
    V = vocab_size or m.vocab_size
    if m.apply_layernorm_1p:  # our weights hold gamma - 1
        state = {k: v + 1 if k.endswith("layernorm.weight") else v for k, v in state.items()}
    out = {prefix + ("wte.weight" if kind == GPT2 else "embed_tokens.weight"):
           state["layers.0.word_embeddings.weight"][:V]}
    if kind == GPT2:
        out[prefix + "wpe.weight"] = state["layers.0.position_embeddings.weight"]
    for i in range(L):
        ours = {k[len(f"layers.{i + 1}."):]: v for k, v in state.items()
                if k.startswith(f"layers.{i + 1}.")}
        names = _layer_names(kind, i)
        for name, value in ours.items():
            if name in names:
                out[prefix + names[name]] = value
        out.update({prefix + k: v for k, v in
                    (_attention_to_gpt2 if kind == GPT2 else _attention_to_llama)(m, ours, i)
                    .items()})
        out.update({prefix + k: v for k, v in _mlp_to_hf(m, kind, ours, i).items()})
    head = f"layers.{L + 1}."
    norm = "ln_f." if kind == GPT2 else "norm."
    for p in ("weight", "bias"):
        if head + "final_layernorm." + p in state:
            out[prefix + norm + p] = state[head + "final_layernorm." + p]
    if m.untie_embeddings_and_output_weights:
        out["lm_head.weight"] = state[head + "weight"][:V]
    if kind == GPT2:
        _zero_biases(m, out, prefix)
        out = {k: (v.t() if k.endswith(_TRANSPOSED) else v) for k, v in out.items()}
    return {k: v.contiguous() for k, v in out.items()}


def _zero_biases(m: ModelConfig, out: dict, prefix: str) -> None:
    """GPT-2 always has linear biases: a model without them exports zeros."""
    h, f = m.hidden_size, m.ffn_size
    for i in range(m.num_layers):
        for name, n in (("attn.c_attn.bias", 3 * h), ("attn.c_proj.bias", h),
                        ("mlp.c_fc.bias", f), ("mlp.c_proj.bias", h)):
            out.setdefault(f"{prefix}h.{i}.{name}", torch.zeros(n))


def _attention_to_gpt2(m: ModelConfig, ours: dict, i: int) -> dict:
    a, d, h = m.num_attention_heads, m.kv_channels, m.hidden_size
    q, k, v = ours["self_attention.qkv.weight"].view(a, 3, d, h).unbind(1)
    out = {f"h.{i}.attn.c_attn.weight": torch.cat([x.reshape(a * d, h) for x in (q, k, v)])}
    if "self_attention.qv_bias" in ours:
        qb, vb = ours["self_attention.qv_bias"].unbind(1)
        out[f"h.{i}.attn.c_attn.bias"] = torch.cat([qb.reshape(-1), torch.zeros(a * d),
                                                    vb.reshape(-1)])
    return out


def _attention_to_llama(m: ModelConfig, ours: dict, i: int) -> dict:
    G, d, h = m.query_groups, m.kv_channels, m.hidden_size
    P = m.num_attention_heads // G
    w = ours["self_attention.qkv.weight"].view(G, P + 2, d, h)
    pre = f"layers.{i}.self_attn."
    out = {pre + "q_proj.weight": w[:, :P].reshape(G * P * d, h),
           pre + "k_proj.weight": w[:, P].reshape(G * d, h),
           pre + "v_proj.weight": w[:, P + 1].reshape(G * d, h)}
    if "self_attention.qv_bias" in ours:
        b = ours["self_attention.qv_bias"]
        out.update({pre + "q_proj.bias": b[:, :P].reshape(-1), pre + "k_proj.bias":
                    torch.zeros(G * d), pre + "v_proj.bias": b[:, P].reshape(-1)})
    return out


def _mlp_to_hf(m: ModelConfig, kind: str, ours: dict, i: int) -> dict:
    if kind == GPT2:
        return {}  # fc1/fc2 map by name (_layer_names)
    pre = f"layers.{i}.mlp."
    gate, up = ours["mlp.fc1.weight"].unbind(0)
    out = {pre + "gate_proj.weight": gate, pre + "up_proj.weight": up}
    if "mlp.fc1.gate_bias" in ours:
        out.update({pre + "gate_proj.bias": ours["mlp.fc1.gate_bias"],
                    pre + "up_proj.bias": ours["mlp.fc1.up_bias"]})
    return out
