"""Named model shapes (no weights). `--model NAME` picks one; explicit shape flags override it.

The two GPT/BERT sizes beyond the usual ones (2.2B, 3.8B) are those of the PipeDream-2BW paper's
experiments.
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
}


def flavour_shape(name: str, family: str) -> dict:
    """Shape flags of a flavour as Megatron argument names (ValueError on a bad name/family)."""
    if name not in FLAVOURS:
        raise ValueError(f"unknown --model {name!r}: use one of {', '.join(FLAVOURS)}")
    fam, layers, hidden, heads, seq = FLAVOURS[name]
    if fam not in ("any", family):
        raise ValueError(f"--model {name} is a {fam.upper()} flavour: use pretrain_{fam}.py")
    return {"num_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
            "seq_length": seq}
