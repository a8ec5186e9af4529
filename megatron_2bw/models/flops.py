"""Parameters, FLOPs and stashed-activation bytes of GPT- and BERT-shaped transformer models.

Counts follow the modules in `models/` exactly (the tests compare them with the real `nn.Module`s,
with HuggingFace's models and with the engine's buffers): the model is the spec list
`[embedding, transformer x L, head]` and every function below has one entry per spec.

Per transformer layer (h hidden, f ffn, a heads, g key/value groups, d = h/a channels per head,
s sequence, b micro batch, t tensor ranks; GPT-2 shape: g = a, GeLU, LayerNorm, biases):
    parameters   QKV (a + 2g)dh, output projection h^2, MLP 2hf (SwiGLU: 3hf), two norms
                 (LayerNorm 2h each, RMSNorm h), and with biases (a + g)d (query/value, no key
                 bias) + h + f (SwiGLU: 2f) + h        = 12h^2 + 13h for the GPT-2 shape, f = 4h
    fwd FLOPs    2bsh((a + 2g)d + h + f_in + f)/t + 4bs^2h/t   (f_in = f, SwiGLU 2f; attention
                 scores and values in full, as Megatron counts them; RoPE's elementwise work and
                 the norms are not counted)
    activations  sbh*p*(4 + (3 + 2gd/h + k f/h)/t) + 2 norm statistics + 4asb/t bytes with fused
                 (flash) attention, k = 2 (GeLU: fc1 output and activation) or 4 (SwiGLU: gate,
                 up, SiLU(gate), product); RoPE adds its cos and sin tables (2 s r p). The
                 non-fused path keeps the softmax instead: +a s^2 b (p, +p+1 with dropout) / t.
    selective    selective recomputation (core attention) keeps q, k, v but not what the
                 attention kernel saves beyond them (its output sbh*p/t and, fused, the 4asb/t
                 softmax statistics; not fused, the a s^2 b softmax and dropout mask):
                 `core_attention_bytes` is what it frees
    sequence-    the norms' inputs and statistics, the QKV and fc1 inputs (kept as the chunk
    parallel     and gathered again in backward) and the dropout masks are this rank's s/t chunk:
                 the "4" above becomes 4/t, and so do a layer's input and output (what a stage
                 sends); the head keeps the final norm's input (and GPT's output-layer input)
                 as a chunk too, the embedding its dropout mask
Backward costs 2x the forward FLOPs; activation recomputation adds one more forward (selective:
the core attention's 4bs^2h/t, `core_attention_flops`).
Model FLOPs per sample (Megatron's convention): 72 s L h^2 (1 + s/(6h) + V/(12 h L)) for the
GPT-2 shape with f = 4h. Learned position embeddings count only with learned_absolute positions.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from megatron_2bw.config import ModelConfig
from megatron_2bw.models.norm_sizes import norm_params, norm_stats_bytes

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
ARCHS = ("gpt", "bert")


def pad_vocab(vocab: int, multiple: int = 128, tensor: int = 1) -> int:
    """Megatron's padding: round the vocabulary up to a multiple of `multiple * tensor`."""
    step = multiple * tensor
    return ((vocab + step - 1) // step) * step


def _gpt(layers: int, hidden: int, heads: int, seq: int = 2048, vocab: int = 50257) -> ModelConfig:
    return ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                       seq_length=seq, vocab_size=pad_vocab(vocab))


# Named shapes (GPT-3 paper table; vocab 50257 padded to 50304, BERT's 30522 to 30592); the
# `--model` flavours of config/flavours.py are accepted too. `debug` is the tiny test model.
MODELS = {
    "debug": ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32,
                         vocab_size=512),
    "gpt-125m": _gpt(12, 768, 12),
    "gpt-350m": _gpt(24, 1024, 16),
    "gpt-760m": _gpt(24, 1536, 16),
    "gpt-1.3b": _gpt(24, 2048, 16),
    "gpt-2.7b": _gpt(32, 2560, 32),
    "gpt-6.7b": _gpt(32, 4096, 32),
    "gpt-13b": _gpt(40, 5120, 40),
    "gpt-175b": _gpt(96, 12288, 96),
}


def _flavours() -> dict:
    try:
        from megatron_2bw.config.flavours import FLAVOURS
    except ImportError:  # pragma: no cover - flavours are optional
        return {}
    return FLAVOURS


def model_names() -> list:
    return sorted(set(MODELS) | set(_flavours()))


def named_model(name: str) -> ModelConfig:
    if name in MODELS:
        return replace(MODELS[name])
    if name in _flavours():
        from megatron_2bw.config.flavours import flavour_architecture
        family, layers, hidden, heads, seq = _flavours()[name]
        vocab = pad_vocab(30522 if family == "bert" else 50257)
        cfg = replace(_gpt(layers, hidden, heads, seq, vocab), **flavour_architecture(name))
        if family == "bert" and hasattr(cfg, "family"):
            cfg = replace(cfg, family="bert")
        return cfg
    import difflib
    close = difflib.get_close_matches(name, model_names(), n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise ValueError(f"unknown model {name!r}{hint}: use one of {', '.join(model_names())} "
                     "or give the shape flags")


def _model(cfg) -> ModelConfig:
    """Accept a ModelConfig or anything with a `.model` ModelConfig (the full Config)."""
    return getattr(cfg, "model", cfg)


def _arch(cfg, arch: str | None) -> str:
    arch = arch or getattr(cfg, "family", None) or "gpt"
    if arch not in ARCHS:
        raise ValueError(f"unknown model family {arch!r}: use one of {', '.join(ARCHS)}")
    return arch


@dataclass(frozen=True)
class LayerCost:
    """One spec of the model, per tensor-parallel rank and per microbatch of `b` samples."""
    name: str                 # "embedding" | "transformer" | "head"
    params: int               # parameters this layer holds (tied ones included)
    tied_params: int          # of which shared with another layer (the word embedding)
    fwd_flops: float
    bwd_flops: float
    fwd_bytes: float          # memory traffic estimate (for memory-bound layers)
    act_bytes: float          # stashed for the backward, per in-flight microbatch
    input_bytes: float        # the layer's input activation (what recompute keeps)
    output_bytes: float       # what a stage boundary after this layer sends
    core_attention_bytes: float = 0.0  # of act_bytes, what selective recomputation frees
    core_attention_flops: float = 0.0  # of fwd_flops, what selective recomputation repeats
    # forward memory traffic every tensor-parallel rank repeats on the whole b*s*h activation
    # (Megatron without sequence parallelism: the two norms, the two residual adds with their
    # bias and dropout); 0 at t = 1 and with sequence parallelism, which splits them
    replicated_bytes: float = 0.0


def _mlp_in(m: ModelConfig) -> int:
    """Output columns of fc1: f, or 2f with SwiGLU (gate and up)."""
    return (2 if m.swiglu else 1) * m.ffn_size


def _qkv_width(m: ModelConfig) -> int:
    return (m.num_attention_heads + 2 * m.query_groups) * m.kv_channels


def layer_params(cfg, tensor: int = 1, arch: str | None = None) -> list[tuple[int, int]]:
    """[(params, tied params)] per spec, per tensor-parallel rank (as models/gpt.py, bert.py)."""
    m, a = _model(cfg), _arch(cfg, arch)
    h, f, V, P, t = m.hidden_size, m.ffn_size, m.vocab_size, m.max_positions, tensor
    tied = a == "bert" or not m.untie_embeddings_and_output_weights
    word = V * h // t
    emb = word + (P * h if m.position_embedding_type == "learned_absolute" else 0)
    # split across tensor ranks: QKV (no bias), output projection, fc1, fc2, and the
    # query/value and fc1 biases; replicated: two norms, the projection and fc2 biases
    split = h * (_qkv_width(m) + m.num_attention_heads * m.kv_channels + _mlp_in(m) + f)
    replicated = 2 * norm_params(m)
    if getattr(m, "qk_layernorm", False):  # a norm over a head's kv_channels, for q and for k
        replicated += 2 * (norm_params(m) // h) * m.kv_channels
    if m.add_bias_linear:
        split += (m.num_attention_heads + m.query_groups) * m.kv_channels + _mlp_in(m)
        replicated += 2 * h
    layer = split // t + replicated
    head = norm_params(m) + word
    if a == "bert":
        emb += getattr(m, "num_tokentypes", 2) * h
        head += h * h + h + 2 * h + V // t  # LM-head dense + LayerNorm, output bias
        if getattr(m, "bert_binary_head", True):
            head += h * h + h + 2 * h + 2   # pooler, binary head
    out = [(emb, word if tied else 0)]
    out += [(layer, 0)] * m.num_layers
    out.append((head, word if tied else 0))
    return out


def num_parameters(cfg, arch: str | None = None) -> int:
    """Unique parameters of the whole model (a tied embedding counted once)."""
    per = layer_params(cfg, 1, arch)
    return sum(p for p, _ in per) - per[-1][1]


def layer_costs(cfg, micro_batch: int, tensor: int = 1, dtype: str = "fp32",
                arch: str | None = None, flash: bool = True,
                sequence_parallel: bool = False) -> list[LayerCost]:
    m, a = _model(cfg), _arch(cfg, arch)
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPE_BYTES)}")
    p, t, b = DTYPE_BYTES[dtype], tensor, micro_batch
    h, f, V, s, heads = m.hidden_size, m.ffn_size, m.vocab_size, m.seq_length, m.num_attention_heads
    sbh = s * b * h
    drop_h = m.hidden_dropout > 0
    params = layer_params(m, t, a)
    hidden = sbh * p
    tokens = s * b * 8
    sp = t if sequence_parallel else 1  # what the sequence-parallel regions are divided by

    positions = 8 * s if m.position_embedding_type == "learned_absolute" else 0
    emb_act = tokens + positions + (sbh / sp if drop_h else 0)  # token and position indices
    emb = LayerCost("embedding", *params[0], 0.0, 0.0, 3.0 * hidden, emb_act, tokens,
                    hidden / sp)

    core_flops = 4.0 * b * s * s * h / t
    fwd = 2.0 * b * s * h * (_qkv_width(m) + h + _mlp_in(m) + f) / t + core_flops
    attn = 3 + 2 * m.query_groups * m.kv_channels / h  # q, attention output, proj input; k, v
    mlp = (4 if m.swiglu else 2) * f / h
    act = (sbh * p * (4 / sp + (attn + mlp) / t) + 2 * norm_stats_bytes(m, s * b) / sp
           + (2 * sbh / sp if drop_h else 0))
    if m.position_embedding_type == "rope":
        act += 2 * s * m.rotary_dim * p  # the cos and sin tables
    if flash:
        core = sbh * p / t + 4 * heads * s * b / t  # the kernel's output and softmax statistics
    else:  # the softmax (and dropout's mask and output); the output is the projection's input
        core = heads * s * s * b * (p + ((p + 1) if m.attention_dropout > 0 else 0)) / t
    act += core - sbh * p / t  # (`attn` counted the kernel's output once already)
    # norms read and write the activation, residual adds read two and write one (+ a mask byte)
    repeated = 0.0 if t == 1 or sequence_parallel else sbh * (2 * 2 * p + 2 * (3 * p + drop_h))
    layer = LayerCost("transformer", *params[1], fwd, 2 * fwd, 2.0 * act, act, hidden / sp,
                      hidden / sp, core, core_flops, repeated)

    head_fwd = 2.0 * b * s * h * V / t
    # the final norm's input and the output layer's input (a chunk under sequence parallelism,
    # except BERT's, which runs after the LM-head transform on the whole sequence)
    kept = hidden / sp + (hidden if a == "bert" else hidden / sp)
    head_act = kept + norm_stats_bytes(m, s * b) / sp + 4.0 * s * b * V / t + tokens
    if a == "bert":  # LM-head transform (dense, GeLU, LayerNorm) and the pooler
        head_fwd += 2.0 * b * s * h * h + 2.0 * b * h * h
        head_act += 4 * hidden
    head = LayerCost("head", *params[-1], head_fwd, 2 * head_fwd, 2.0 * head_act, head_act,
                     hidden / sp, 0.0)
    return [emb] + [layer] * m.num_layers + [head]


def model_flops_per_sample(cfg, recompute: bool = False, arch: str | None = None) -> float:
    """Training FLOPs of one sample (forward + backward, + one forward with recomputation).
    Multiply by the global batch size and divide by the time per iteration for FLOP/s."""
    costs = layer_costs(cfg, 1, 1, "fp32", arch)
    fwd = sum(c.fwd_flops for c in costs)
    return (4.0 if recompute else 3.0) * fwd


def standard_parameter_count(cfg) -> float:
    """12 L h^2 (1 + 13/(12h) + (V + s)/(12 L h)): the formula of Narayanan et al. (2021)."""
    m = _model(cfg)
    L, h, V, s = m.num_layers, m.hidden_size, m.vocab_size, m.max_positions
    return 12.0 * L * h * h * (1 + 13.0 / (12 * h) + (V + s) / (12.0 * L * h))


__all__ = ["DTYPE_BYTES", "MODELS", "LayerCost", "layer_costs", "layer_params", "named_model",
           "num_parameters", "model_flops_per_sample", "pad_vocab", "standard_parameter_count"]
