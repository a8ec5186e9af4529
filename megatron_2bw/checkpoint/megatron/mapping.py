"""Megatron's parameter names and layouts <-> this project's: the one map that every Megatron
reader and writer uses (megatron-core torch_dist, `--ckpt-format torch` with megatron-core or
legacy names, Megatron-DeepSpeed's per-layer files).

A `Link` ties one of our one-process parameters (checkpoint/names.py: `layers.<spec>.<path>`;
transformer layer i of L is spec i + 1) to one megatron-core parameter named as its module names
it in a one-process model (the *logical* name; layer i of the block is `decoder.layers.i.`, BERT's
block is `encoder`), with the layout between them (`kind`):

    ours  layers.<..>                       megatron-core                        legacy (torch format)
    0.word_embeddings.weight [V, h]         embedding.word_embeddings.weight     language_model.embedding.word_embeddings.weight
    0.position_embeddings.weight            embedding.position_embeddings.weight language_model.embedding.position_embeddings.weight
    0.tokentype_embeddings.weight (BERT)    embedding.tokentype_embeddings.weight language_model.embedding.tokentype_embeddings.weight
    i+1.input_layernorm.*                   B.layers.i.input_layernorm.*         language_model.encoder.layers.i.input_layernorm.* (input_norm)
    i+1.self_attention.qkv.weight           ..self_attention.linear_qkv.weight   ..self_attention.query_key_value.weight
    i+1.self_attention.qv_bias   QV         ..self_attention.linear_qkv.bias     ..self_attention.query_key_value.bias
    i+1.self_attention.proj.*               ..self_attention.linear_proj.*       ..self_attention.dense.*
    i+1.self_attention.{q,k}_layernorm.*    ..self_attention.{q,k}_layernorm.*   (none)
    i+1.post_attention_layernorm.*          ..pre_mlp_layernorm.*                ..post_attention_layernorm.* (post_attention_norm)
    i+1.mlp.fc1.weight           GATED/SAME ..mlp.linear_fc1.weight              ..mlp.dense_h_to_4h.weight
    i+1.mlp.fc1.{gate,up}_bias   GATE, UP   ..mlp.linear_fc1.bias                ..mlp.dense_h_to_4h.bias
    i+1.mlp.fc1.bias, fc2.*                 ..mlp.linear_fc1.bias, linear_fc2.*  ..mlp.dense_h_to_4h.bias, dense_4h_to_h.*
    L+1.final_layernorm.*                   B.final_layernorm.*                  language_model.encoder.final_layernorm.* (final_norm)
    L+1.weight (untied GPT)                 output_layer.weight                  language_model.output_layer.weight
    L+1.lm_bias (BERT)                      output_layer.bias                    lm_head.bias
    L+1.lm_dense.*, lm_layernorm.*          lm_head.dense.*, lm_head.layer_norm.* lm_head.dense.*, lm_head.layernorm.* (norm)
    L+1.pooler.*, binary_head.*             pooler.dense.*, binary_head.*        language_model.pooler.dense.*, binary_head.*

(B: `decoder` for GPT, `encoder` for BERT; a legacy checkpoint of older code says `transformer`
for `encoder` and `.attention.` for `.self_attention.`.) Megatron-DeepSpeed's layer files hold
the legacy layer names without the `language_model.encoder.layers.i.` prefix (`legacy_layer`).

Layouts (`kind`):
- SAME: elementwise equal. QKV weights agree as they are: both lay the fused QKV out per query
  group as [q_1 .. q_P, k, v] (P = heads / groups; megatron-core's `linear_qkv`, Megatron's
  legacy `query_key_value` from checkpoint_version 2.0 on, and models/attention.py).
- QV: ours keeps the query and value biases [G, P + 1, d] and no key bias (softmax ignores it
  without RoPE or --qk-layernorm); theirs is the whole QKV bias [G * (P + 2) * d]. Their key rows
  are read to check them (`key_pieces`) and written as zeros.
- GATED: SwiGLU's fc1, ours [2, f, h] (0: gate, 1: up), theirs [2f, h] = [gate; up] as
  megatron-core's sharded checkpoints hold it globally (its ShardedTensorFactory splits each
  tensor rank's [gate_r; up_r]); GATE / UP: the two halves of its bias.
- Padded vocabularies: word embeddings, output layer and BERT's output bias hold the padded
  vocabulary on both sides (Megatron's padded_vocab_size is our --vocab-size after padding).

In a torch-format file each tensor rank holds its shard: `tp_dim` says along which dim, and
`merge_tp` joins them (SwiGLU's fc1 per rank is [gate_r; up_r]).

`pieces` maps any box of one of our global tensors (offsets, sizes: a tensor-parallel shard, a
distributed optimizer's flat piece) to the boxes of theirs that hold it and the view of our box
each fills, so a reader reads and a writer writes boxes, never whole models. Stacked layers
(megatron-core's sharded keys `decoder.layers.<rest>` with a leading layer axis) are `dist_key`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

SAME, QV, GATED, GATE, UP = "same", "qv", "gated", "gate", "up"


@dataclass(frozen=True)
class Link:
    ours: str
    theirs: str          # the logical megatron-core name (one layer, unstacked)
    kind: str
    shape: tuple         # theirs' full shape
    ours_shape: tuple


@dataclass(frozen=True)
class TheirBox:
    """A box of theirs (`offsets`, `sizes`) and the view of our box tensor that holds it."""
    offsets: tuple
    sizes: tuple
    select: Callable[[torch.Tensor], torch.Tensor]


def block_name(family: str) -> str:
    return "decoder" if family == "gpt" else "encoder"


def links(m) -> list[Link]:
    """Every parameter of the model `m` (a ModelConfig) with its Megatron counterpart."""
    h, L, V, f = m.hidden_size, m.num_layers, m.vocab_size, m.ffn_size
    G, d, heads = m.query_groups, m.kv_channels, m.num_attention_heads
    block, bias = block_name(m.family), m.add_bias_linear
    out: list[Link] = []

    def same(ours, theirs, shape):
        out.append(Link(ours, theirs, SAME, tuple(shape), tuple(shape)))

    def norm(ours, theirs, n=h, layer_norm=m.normalization == "LayerNorm"):
        same(ours + ".weight", theirs + ".weight", (n,))
        if layer_norm:
            same(ours + ".bias", theirs + ".bias", (n,))

    same("layers.0.word_embeddings.weight", "embedding.word_embeddings.weight", (V, h))
    if m.position_embedding_type == "learned_absolute":
        same("layers.0.position_embeddings.weight", "embedding.position_embeddings.weight",
             (m.max_positions, h))
    if m.family == "bert":
        same("layers.0.tokentype_embeddings.weight", "embedding.tokentype_embeddings.weight",
             (m.num_tokentypes, h))
    for i in range(L):
        o, t = f"layers.{i + 1}.", f"{block}.layers.{i}."
        norm(o + "input_layernorm", t + "input_layernorm")
        qkv = (heads + 2 * G) * d
        same(o + "self_attention.qkv.weight", t + "self_attention.linear_qkv.weight", (qkv, h))
        if bias:
            out.append(Link(o + "self_attention.qv_bias", t + "self_attention.linear_qkv.bias",
                            QV, (qkv,), (G, heads // G + 1, d)))
        same(o + "self_attention.proj.weight", t + "self_attention.linear_proj.weight",
             (h, heads * d))
        if bias:
            same(o + "self_attention.proj.bias", t + "self_attention.linear_proj.bias", (h,))
        if m.qk_layernorm:
            for x in "qk":
                norm(o + f"self_attention.{x}_layernorm", t + f"self_attention.{x}_layernorm", d)
        norm(o + "post_attention_layernorm", t + "pre_mlp_layernorm")
        if m.swiglu:
            out.append(Link(o + "mlp.fc1.weight", t + "mlp.linear_fc1.weight", GATED, (2 * f, h),
                            (2, f, h)))
            if bias:
                out += [Link(o + f"mlp.fc1.{k}_bias", t + "mlp.linear_fc1.bias", kind, (2 * f,),
                             (f,)) for k, kind in (("gate", GATE), ("up", UP))]
        else:
            same(o + "mlp.fc1.weight", t + "mlp.linear_fc1.weight", (f, h))
            if bias:
                same(o + "mlp.fc1.bias", t + "mlp.linear_fc1.bias", (f,))
        same(o + "mlp.fc2.weight", t + "mlp.linear_fc2.weight", (h, f))
        if bias:
            same(o + "mlp.fc2.bias", t + "mlp.linear_fc2.bias", (h,))
    head = f"layers.{L + 1}."
    norm(head + "final_layernorm", f"{block}.final_layernorm")
    if m.family == "gpt" and m.untie_embeddings_and_output_weights:
        same(head + "weight", "output_layer.weight", (V, h))
    if m.family == "bert":
        same(head + "lm_bias", "output_layer.bias", (V,))
        same(head + "lm_dense.weight", "lm_head.dense.weight", (h, h))
        same(head + "lm_dense.bias", "lm_head.dense.bias", (h,))
        norm(head + "lm_layernorm", "lm_head.layer_norm", layer_norm=True)
        if m.bert_binary_head:
            same(head + "pooler.weight", "pooler.dense.weight", (h, h))
            same(head + "pooler.bias", "pooler.dense.bias", (h,))
            same(head + "binary_head.weight", "binary_head.weight", (2, h))
            same(head + "binary_head.bias", "binary_head.bias", (2,))
    return out


# -- boxes -----------------------------------------------------------------------------------------
def _whole(t: torch.Tensor) -> torch.Tensor:
    return t


def pieces(link: Link, offsets: tuple, sizes: tuple) -> list[TheirBox]:
    """The boxes of `link.theirs` that hold the box (offsets, sizes) of `link.ours`, each with
    the view of our box tensor (shape `sizes`, contiguous) it corresponds to; every view is
    contiguous and shaped like its box."""
    kind = link.kind
    if kind == SAME:
        return [TheirBox(tuple(offsets), tuple(sizes), _whole)]
    if kind in (GATE, UP):
        shift = 0 if kind == GATE else link.ours_shape[0]
        return [TheirBox((offsets[0] + shift,), tuple(sizes), _whole)]
    if kind == GATED:
        f = link.ours_shape[1]
        return [TheirBox((half * f + offsets[1], *offsets[2:]), tuple(sizes[1:]),
                      lambda t, k=half - offsets[0]: t[k])
                for half in range(offsets[0], offsets[0] + sizes[0])]
    return _qv_pieces(link, offsets, sizes)


def _qv_pieces(link: Link, offsets: tuple, sizes: tuple) -> list[TheirBox]:
    """QV: our rows (g, p) -> their rows g * (P + 2) + (p if p < P else P + 1), d wide."""
    _, P1, d = link.ours_shape
    P = P1 - 1
    (g0, p0, d0), (ng, npp, nd) = offsets, sizes
    out = []
    for g in range(g0, g0 + ng):
        base = g * (P + 2) * d
        if nd < d:  # a part of one row (flat_range_boxes: the box is then one row)
            row = p0 if p0 < P else P + 1
            out.append(TheirBox((base + row * d + d0,), (nd,),
                             lambda t, i=g - g0: t[i, 0]))
            continue
        q_hi = min(p0 + npp, P)
        if q_hi > p0:
            out.append(TheirBox((base + p0 * d,), ((q_hi - p0) * d,),
                             lambda t, i=g - g0, n=q_hi - p0: t[i, :n].reshape(-1)))
        if p0 + npp > P:
            out.append(TheirBox((base + (P + 1) * d,), (d,),
                             lambda t, i=g - g0, j=P - p0: t[i, j]))
    return out


def key_pieces(link: Link, offsets: tuple, sizes: tuple) -> list[tuple[tuple, tuple]]:
    """QV: their key-bias rows of the groups whose first element the box holds (so the boxes of
    a whole tensor name each group once): read to check them, written as zeros."""
    if link.kind != QV:
        return []
    _, P1, d = link.ours_shape
    P = P1 - 1
    (g0, p0, d0), (ng, _, _) = offsets, sizes
    if p0 or d0:
        return []
    return [((g * (P + 2) * d + P * d,), (d,)) for g in range(g0, g0 + ng)]


def box(t: torch.Tensor, offsets: tuple, sizes: tuple) -> torch.Tensor:
    for dim, (o, n) in enumerate(zip(offsets, sizes)):
        t = t.narrow(dim, o, n)
    return t


def to_ours(link: Link, theirs: torch.Tensor) -> torch.Tensor:
    """Our full tensor of `link` from their full tensor."""
    out = torch.empty(link.ours_shape, dtype=theirs.dtype)
    for p in pieces(link, (0,) * len(link.ours_shape), link.ours_shape):
        p.select(out).copy_(box(theirs, p.offsets, p.sizes))
    return out


def to_theirs(link: Link, ours: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
    """Their full tensor of `link` from ours (`into`: theirs so far, for the links that share a
    tensor: GATE and UP); key-bias rows are zeros."""
    out = torch.zeros(link.shape, dtype=ours.dtype) if into is None else into
    for p in pieces(link, (0,) * len(link.ours_shape), link.ours_shape):
        box(out, p.offsets, p.sizes).copy_(p.select(ours))
    return out


def key_bias(link: Link, theirs: torch.Tensor) -> torch.Tensor:
    """QV: their key-bias rows, [G, d]."""
    G, _, d = link.ours_shape
    return torch.stack([box(theirs, o, s) for o, s in key_pieces(link, (0, 0, 0), (G, 1, d))])


def theirs_tensors(m, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Megatron's full tensors (logical names) of our full state (one-process names)."""
    out: dict[str, torch.Tensor] = {}
    for link in links(m):
        out[link.theirs] = to_theirs(link, state[link.ours], out.get(link.theirs))
    return out


# -- name sets -------------------------------------------------------------------------------------
_LAYER = re.compile(r"^(decoder|encoder)\.layers\.(\d+)\.(.+)$")
# megatron-core's transformer-engine spec fuses the pre-norms into the next linear; its sharded
# keys use these names with either spec (the local spec's sharded_state_dict_keys_map)
TE_NAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
            "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
            "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
            "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias"}
_FROM_TE = {v: k for k, v in TE_NAMES.items()}


def layer_of(theirs: str) -> tuple[str, int, str] | None:
    """(block, layer index, name within the layer) of a logical layer parameter, else None."""
    m = _LAYER.match(theirs)
    return (m.group(1), int(m.group(2)), m.group(3)) if m else None


def dist_key(theirs: str, stacked: bool = True) -> tuple[str, int | None]:
    """megatron-core's sharded key of a logical name and the index along its leading layer axis:
    layers stack (`decoder.layers.self_attention.linear_qkv.weight` [L, ...]) unless
    `stacked` is False (its singleton_local_shards form: `decoder.layers.3.<...>`)."""
    parts = layer_of(theirs)
    if parts is None:
        return theirs, None
    block, i, rest = parts
    rest = TE_NAMES.get(rest, rest)
    return (f"{block}.layers.{rest}", i) if stacked else (f"{block}.layers.{i}.{rest}", None)


def from_module_name(key: str) -> str:
    """A megatron-core state-dict key (local or transformer-engine spec) -> the logical name."""
    parts = layer_of(key)
    if parts is None:
        return key
    block, i, rest = parts
    return f"{block}.layers.{i}.{_FROM_TE.get(rest, rest)}"


# Megatron's legacy layer names (megatron/legacy/model/transformer.py, older and newer spellings;
# Megatron-DeepSpeed's ParallelTransformerLayerPipe files hold these) -> megatron-core's
LEGACY_LAYER = {"input_layernorm": "input_layernorm", "input_norm": "input_layernorm",
                "self_attention.query_key_value": "self_attention.linear_qkv",
                "self_attention.dense": "self_attention.linear_proj",
                "post_attention_layernorm": "pre_mlp_layernorm",
                "post_attention_norm": "pre_mlp_layernorm",
                "mlp.dense_h_to_4h": "mlp.linear_fc1", "mlp.dense_4h_to_h": "mlp.linear_fc2"}
_LEGACY_TOP = {"language_model.embedding.": "embedding.", "language_model.pooler.": "pooler.",
               "language_model.output_layer.": "output_layer.", "lm_head.layernorm.":
               "lm_head.layer_norm.", "lm_head.norm.": "lm_head.layer_norm.",
               "lm_head.bias": "output_layer.bias", "lm_head.dense.": "lm_head.dense.",
               "binary_head.": "binary_head."}
TIED_HEAD_COPY = "word_embeddings_for_head.weight"  # a last stage's copy of the tied embedding


def legacy_layer(local: str) -> str | None:
    """A legacy layer-local name (`self_attention.query_key_value.weight`) -> megatron-core's
    (`self_attention.linear_qkv.weight`); None when it is not a parameter."""
    if local.startswith("attention."):  # the name before `self_attention`
        local = "self_" + local
    module, _, param = local.rpartition(".")
    mapped = LEGACY_LAYER.get(module)
    return f"{mapped}.{param}" if mapped and param in ("weight", "bias") else None


def from_legacy(key: str, family: str) -> str | None:
    """A flattened legacy key (`language_model.encoder.layers.3.mlp.dense_h_to_4h.weight`) -> the
    logical name; None for what is no parameter of its own (the tied head copy, extra state)."""
    block = block_name(family)
    for enc in ("language_model.encoder.", "language_model.transformer."):
        if key.startswith(enc):
            rest = key[len(enc):]
            if rest.startswith("layers."):
                i, _, local = rest[len("layers."):].partition(".")
                mapped = legacy_layer(local)
                return f"{block}.layers.{i}.{mapped}" if mapped else None
            for final in ("final_layernorm.", "final_norm."):
                if rest.startswith(final):
                    return f"{block}.final_layernorm.{rest[len(final):]}"
            return None
    for old, new in _LEGACY_TOP.items():
        if key == old or (old.endswith(".") and key.startswith(old)):
            return new + key[len(old):]
    return None


def tp_dim(theirs: str) -> int | None:
    """Along which dim a tensor rank holds its shard of a logical parameter (None: whole)."""
    name = (layer_of(theirs) or (None, None, theirs))[2]
    if name in ("embedding.word_embeddings.weight", "output_layer.weight", "output_layer.bias",
                "self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias",
                "mlp.linear_fc1.weight", "mlp.linear_fc1.bias"):
        return 0
    if name in ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight"):
        return 1
    return None


def merge_tp(theirs: str, shards: list[torch.Tensor], gated: bool) -> torch.Tensor:
    """The full tensor of a logical parameter from its tensor ranks' shards (in rank order);
    `gated`: SwiGLU, where each rank's fc1 is [gate_r; up_r]."""
    dim = tp_dim(theirs)
    if dim is None or len(shards) == 1:
        return shards[0]
    if gated and (layer_of(theirs) or ("", 0, ""))[2].startswith("mlp.linear_fc1."):
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=dim)
