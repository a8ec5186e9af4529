"""Megatron's architecture flags (names, meanings, defaults: the GPT-2 shape) and how they and a
--model flavour fill a ModelConfig; config/flags.py and planner/cli.py add them. Choice values
are taken in either peer's spelling (`spelled`: Megatron-LM's RMSNorm, Megatron-DeepSpeed's
rmsnorm)."""
from __future__ import annotations

import argparse
from dataclasses import replace

from megatron_2bw.config.flavours import flavour_architecture
from megatron_2bw.config.schema import ModelConfig


# -- architecture flags (Megatron's names and meanings) -------------------------------------------
# flag -> ModelConfig field; None defaults mean "not given": the --model flavour's value, else the
# ModelConfig default (the GPT-2 shape)
ARCHITECTURE_FLAGS = {"position_embedding_type": "position_embedding_type",
                      "rotary_base": "rotary_base", "rotary_percent": "rotary_percent",
                      "normalization": "normalization", "norm_epsilon": "layernorm_epsilon",
                      "swiglu": "swiglu", "group_query_attention": "group_query_attention",
                      "num_query_groups": "num_query_groups", "openai_gelu": "openai_gelu",
                      "kv_channels": "num_kv_channels", "apply_layernorm_1p": "apply_layernorm_1p",
                      "qk_layernorm": "qk_layernorm"}


NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def spelled(choices):
    """argparse type of a choice taken in any letter case (Megatron-LM's LayerNorm,
    Megatron-DeepSpeed's layernorm): the value in the first spelling."""
    by_lower = {c.lower(): c for c in choices}
    return lambda value: by_lower.get(value.lower(), value)


def add_architecture_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("architecture (Megatron's flags; default: the GPT-2 shape)")
    g.add_argument("--position-embedding-type", choices=("learned_absolute", "rope"),
                   default=None, help="rope: rotary embeddings, no learned position table")
    g.add_argument("--rotary-base", type=float, default=None, help="RoPE base (10000)")
    g.add_argument("--rotary-percent", type=float, default=None,
                   help="fraction of each head's channels rotated (1.0)")
    g.add_argument("--normalization", choices=NORMALIZATIONS, default=None,
                   type=spelled(NORMALIZATIONS),
                   help="LayerNorm or RMSNorm (Megatron-DeepSpeed's layernorm, rmsnorm too)")
    g.add_argument("--norm-epsilon", "--layernorm-epsilon", dest="norm_epsilon", type=float,
                   default=None, help="(1e-5; --layernorm-epsilon: Megatron-DeepSpeed's name)")
    g.add_argument("--swiglu", action="store_true", default=None,
                   help="gated SiLU MLP; --ffn-hidden-size defaults to int(8h/3 / 64) * 64")
    g.add_argument("--group-query-attention", action="store_true", default=None)
    g.add_argument("--num-query-groups", type=int, default=None,
                   help="key/value heads with --group-query-attention (1)")
    g.add_argument("--disable-bias-linear", action="store_true", default=None,
                   help="no biases in the linear layers (norms keep theirs)")
    g.add_argument("--openai-gelu", action="store_true", default=None,
                   help="tanh-approximated GeLU (GPT-2's gelu_new)")
    g.add_argument("--kv-channels", type=int, default=None,
                   help="channels per attention head (default: hidden size / heads)")
    g.add_argument("--apply-layernorm-1p", action="store_true", default=None,
                   help="norm weights stored as gamma - 1 (zero at init, weight decay pulls "
                        "gamma to 1): Megatron's zero-centred gamma, LayerNorm and RMSNorm")
    g.add_argument("--qk-layernorm", action="store_true", default=None,
                   help="a norm (of --normalization's kind) over each query and key head, "
                        "before RoPE; at --tensor-model-parallel-size > 1 with "
                        "--sequence-parallel")


def apply_architecture_args(model: ModelConfig, args: argparse.Namespace) -> ModelConfig:
    """The model with the --model flavour's architecture and the architecture flags applied
    (a flag beats the flavour; the vocabulary still comes from the data)."""
    fields = flavour_architecture(getattr(args, "model", None) or "")
    fields.pop("vocab_size", None)
    if getattr(args, "ffn_hidden_size", None) is not None:
        fields.pop("ffn_hidden_size", None)
    if getattr(args, "untie_embeddings_and_output_weights", False):
        fields["untie_embeddings_and_output_weights"] = True
    for flag, field_name in ARCHITECTURE_FLAGS.items():
        if getattr(args, flag, None) is not None:
            fields[field_name] = getattr(args, flag)
    if getattr(args, "disable_bias_linear", None):
        fields["add_bias_linear"] = False
    return replace(model, **fields)
