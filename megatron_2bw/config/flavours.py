"""Named model shapes (no weights). `--model NAME` picks one; explicit shape flags override it.

The two GPT/BERT sizes beyond the usual ones (2.2B, 3.8B) are those of the PipeDream-2BW paper's
experiments. The `llama-*` flavours are Llama-shaped GPTs (RoPE, RMSNorm, SwiGLU, grouped-query
attention, no linear biases): `llama-debug` is the tiny test model; the others are the shapes of
Llama 3.2 1B / 3B and Llama 3.1 8B (for the planner; `LLAMA` holds what the classic tuple lacks).
"""
from __future__ import annotations

# name: (family, num_layers, hidden_size, num_attention_heads, seq_length)
FLAVOURS: dict[str, tuple[str, int, int, int, int]] = {
    "debug": ("any", 2, 64, 4, 32),
    "gpt-125m": ("gpt", 12, 768, 12, 2048),
    "gpt-355m": ("gpt", 24, 1024, 16, 2048),
    "gpt-1.3b": ("gpt", 24, 2048, 16, 2048),
    "gpt-2.2b": ("gpt", 32, 2304, 32, 2048),
    "gpt-3.8b": ("gpt", 32, 3072, 32, 2048),
    "bert-base": ("bert", 12, 768, 12, 512),
    "bert-large": ("bert", 24, 1024, 16, 512),
    "bert-2.2b": ("bert", 32, 2304, 32, 512),
    "bert-3.8b": ("bert", 32, 3072, 32, 512),
    "llama-debug": ("gpt", 2, 64, 4, 32),
    "llama-3.2-1b": ("gpt", 16, 2048, 32, 8192),
    "llama-3.2-3b": ("gpt", 28, 3072, 24, 8192),
    "llama-3.1-8b": ("gpt", 32, 4096, 32, 8192),
}

# Llama flavours: (query groups, ffn hidden size or None for Megatron's SwiGLU default,
# rotary base, vocabulary or None (from the data), tied embeddings)
LLAMA: dict[str, tuple] = {
    "llama-debug": (2, None, 10000.0, 512, False),
    "llama-3.2-1b": (8, 8192, 500000.0, 128256, True),
    "llama-3.2-3b": (8, 8192, 500000.0, 128256, True),
    "llama-3.1-8b": (8, 14336, 500000.0, 128256, False),
}


def llama_architecture(query_groups: int, rotary_base: float = 10000.0) -> dict:
    """The ModelConfig fields of the Llama shape."""
    return {"position_embedding_type": "rope", "rotary_base": rotary_base,
            "normalization": "RMSNorm", "swiglu": True, "group_query_attention": True,
            "num_query_groups": query_groups, "add_bias_linear": False}


def flavour_architecture(name: str) -> dict:
    """ModelConfig fields beyond the shape tuple (architecture, ffn size, untied embeddings,
    vocabulary); empty for the classic flavours."""
    if name not in LLAMA:
        return {}
    groups, ffn, base, vocab, tied = LLAMA[name]
    fields = llama_architecture(groups, base)
    fields["untie_embeddings_and_output_weights"] = not tied
    if ffn is not None:
        fields["ffn_hidden_size"] = ffn
    if vocab is not None:
        fields["vocab_size"] = vocab
    return fields


def flavour_shape(name: str, family: str) -> dict:
    """Shape flags of a flavour as Megatron argument names (ValueError on a bad name/family)."""
    if name not in FLAVOURS:
        raise ValueError(f"unknown --model {name!r}: use one of {', '.join(FLAVOURS)}")
    fam, layers, hidden, heads, seq = FLAVOURS[name]
    if fam not in ("any", family):
        raise ValueError(f"--model {name} is a {fam.upper()} flavour: use pretrain_{fam}.py")
    return {"num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
            "seq_length": seq}
