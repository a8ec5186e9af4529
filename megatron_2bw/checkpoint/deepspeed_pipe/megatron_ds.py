"""Megatron-DeepSpeed's GPTModelPipe in DeepSpeed's pipeline checkpoint -> Megatron's logical
names (checkpoint/megatron/mapping.py, the one map to this project's), whole tensors.

GPTModelPipe (megatron/model/gpt_model.py, deepspeedai/Megatron-DeepSpeed) is a PipelineModule
whose layer list is [a cast, EmbeddingPipe (TiedLayerSpec 'embed' unless untied; older versions
follow it with a transposing lambda), ParallelTransformerLayerPipe x L, the final LayerNorm /
RMSNorm, the head (the tied embedding with a forward_fn, saved nothing, or LMHeadPipe), maybe a
cast]. Only modules with state are saved, so each layer file's keys say its role (`roles`):

    word_embeddings.weight, position_embeddings.weight   embedding  <- language_model.embedding.*
    input_layernorm.*, self_attention.*, mlp.* ...       layer i    <- legacy layer names
                                                                       (mapping.legacy_layer)
    weight (, bias) after the last layer                 final norm <- ..encoder.final_layernorm
    lm_head.weight                                       output     <- ..output_layer.weight

A stage module's parameter names (its optimizer's) are `tied_modules.embed.<key>` and
`<layer index>.<key>`. The fused QKV is per query group [q_1 .. q_P, k, v] (checkpoint_version
3.0, as Megatron-LM) up to commit 676a482 (Dec 2024), in equal thirds [Q; K; V] per tensor rank
from then on: the args of those versions hold ds_sequence_parallel_fpdt (`thirds`), and
`per_group` reorders them (grouped-query attention in thirds cannot be told apart: refused).
Megatron-DeepSpeed's argument names differ from Megatron-LM's in places (`lm_args`).
"""
from __future__ import annotations

from collections import defaultdict

import torch

from megatron_2bw.checkpoint.deepspeed_pipe.files import TagFiles, read_file
from megatron_2bw.checkpoint.files import CheckpointError
from megatron_2bw.checkpoint.megatron import mapping

EMBEDDING, LAYER, FINAL_NORM, OUTPUT = "embedding", "layer", "final norm", "output layer"
_QKV = "self_attention.linear_qkv."


def lm_args(args: dict) -> dict:
    """Megatron-DeepSpeed's arguments (megatron/arguments.py) in Megatron-LM's names, which
    checkpoint/megatron/common.py reads."""
    if not args:
        return {}
    out = dict(args)
    heads, kv = args.get("num_attention_heads"), args.get("num_key_value_heads")
    if kv is not None and "num_query_groups" not in args:
        out.update(group_query_attention=kv != heads, num_query_groups=kv)
    norm = args.get("normalization")
    if isinstance(norm, str) and norm.lower() in ("layernorm", "rmsnorm"):
        out["normalization"] = "LayerNorm" if norm.lower() == "layernorm" else "RMSNorm"
    if "position_embedding_type" not in args:
        out["position_embedding_type"] = "rope" if args.get("use_rotary_position_embeddings") \
            else "learned_absolute" if args.get("add_position_embedding", True) else "none"
    if args.get("rope_theta") is not None and "rotary_base" not in args:
        out["rotary_base"] = args["rope_theta"]
    experts = args.get("num_experts")
    if isinstance(experts, (list, tuple)):  # one count per expert layer, [1] without experts
        out["num_experts"] = max(experts) if experts and max(experts) > 1 else None
    return out


def unsupported(args: dict) -> list[str]:
    """What Megatron-DeepSpeed's arguments use that this project does not build (beyond what
    checkpoint/megatron/common.py asks of Megatron-LM's)."""
    return [f"it uses {what}, which this project does not build" for on, what in (
        (args.get("apply_residual_connection_post_layernorm"),
         "--apply-residual-connection-post-layernorm"),
        (args.get("num_experts_switch"), "--num-experts-switch (a switch MLP)")) if on]


def thirds(args: dict) -> bool:
    """Whether the QKV is laid out in equal thirds (Megatron-DeepSpeed from 676a482 on)."""
    return "ds_sequence_parallel_fpdt" in args


def roles(files: TagFiles) -> dict[int, tuple[str, int]]:
    """layer index -> (role, transformer layer number) from each layer file's keys (tensor
    rank 0's); a file of no role is one CheckpointError (not Megatron-DeepSpeed's GPTModelPipe)."""
    out, number, last_layer = {}, 0, None
    for idx in sorted(files.layers):
        path = files.layers[idx][min(files.layers[idx])]
        keys = [k for k, v in read_file(path).items() if torch.is_tensor(v)]
        if "word_embeddings.weight" in keys:
            out[idx] = (EMBEDDING, 0)
        elif any(mapping.legacy_layer(k) for k in keys):
            out[idx], number, last_layer = (LAYER, number), number + 1, idx
        elif keys == ["lm_head.weight"]:
            out[idx] = (OUTPUT, 0)
        elif set(keys) <= {"weight", "bias"} and last_layer is not None and idx > last_layer:
            out[idx] = (FINAL_NORM, 0)
        else:
            raise CheckpointError(
                f"checkpoint {files.directory} is a DeepSpeed pipeline checkpoint whose layer "
                f"{idx} ({', '.join(keys[:3]) or 'no tensors'}) is no layer of "
                "Megatron-DeepSpeed's GPTModelPipe: --load reads Megatron-DeepSpeed's GPT; load "
                "other models with the DeepSpeed drop-in's engine.load_checkpoint and the "
                "PipelineModule that saved it")
    if number == 0 or EMBEDDING not in {r for r, _ in out.values()}:
        raise CheckpointError(f"checkpoint {files.directory} lacks the layer files of "
                              f"{'its embedding' if number else 'any transformer layer'} "
                              "(Megatron-DeepSpeed's GPTModelPipe saves one per layer): the "
                              "checkpoint is incomplete; copy it again or load another tag")
    return out


def check_layers(files: TagFiles, by_index: dict, args: dict) -> None:
    """The transformer layer files number as many as the arguments' layers (one
    CheckpointError when one is missing)."""
    layers = sum(1 for r, _ in by_index.values() if r == LAYER)
    if args.get("num_layers") not in (None, layers):
        raise CheckpointError(f"checkpoint {files.directory} holds {layers} transformer layer "
                              f"files, its arguments say num_layers {args['num_layers']}: a "
                              "layer file is missing (the checkpoint is incomplete); copy it "
                              "again or load another tag")


def logical(role: tuple[str, int], local: str) -> str | None:
    """Megatron's logical name of a layer file's key (None: no parameter of its own)."""
    kind, i = role
    legacy = {EMBEDDING: "language_model.embedding.",
              LAYER: f"language_model.encoder.layers.{i}.",
              FINAL_NORM: "language_model.encoder.final_layernorm.",
              OUTPUT: "language_model.output_layer."}[kind]
    if kind == OUTPUT:
        local = local[len("lm_head."):] if local.startswith("lm_head.") else local
    return mapping.from_legacy(legacy + local, "gpt")


def module_name(name: str, by_index: dict[int, tuple[str, int]]) -> str | None:
    """A stage module's parameter name (`tied_modules.embed.word_embeddings.weight`,
    `3.mlp.dense_h_to_4h.weight`) -> the logical name."""
    head, _, local = name.partition(".")
    if head == "tied_modules":
        _key, _, local = local.partition(".")
        role = next((r for r in by_index.values() if r[0] == EMBEDDING), None)
        return None if role is None else logical(role, local)
    if head.isdigit() and int(head) in by_index:
        return logical(by_index[int(head)], local)
    return None


def per_group(name: str, t: torch.Tensor, m) -> torch.Tensor:
    """One tensor rank's QKV (or its moments) from thirds [Q_r; K_r; V_r] into the per-group
    [q, k, v] rows (multi-head attention: P = 1); other tensors as they are."""
    if _QKV not in name:
        return t
    if m.query_groups != m.num_attention_heads:
        raise CheckpointError("this Megatron-DeepSpeed version (from commit 676a482) splits "
                              "the fused QKV in equal thirds, which does not hold grouped-query "
                              f"attention's ({m.num_attention_heads} heads, {m.query_groups} "
                              "groups): it cannot load exactly")
    rows = t.shape[0] // 3
    heads = rows // m.kv_channels
    return t.reshape(3, heads, m.kv_channels, *t.shape[1:]).transpose(0, 1).reshape(t.shape)


def full_weights(files: TagFiles, by_index: dict, m, in_thirds: bool
                 ) -> tuple[dict[str, torch.Tensor], dict, list[str]]:
    """(every logical tensor whole: tensor ranks joined by mapping.merge_tp, the shape of each
    tensor rank's shard by (name, rank), the layer keys that are no parameter)."""
    shards, left = defaultdict(dict), []
    for idx, by_tp in sorted(files.layers.items()):
        for tp, path in sorted(by_tp.items()):
            for key, value in read_file(path, check=False).items():
                name = logical(by_index[idx], key) if torch.is_tensor(value) else None
                if name is None:
                    if torch.is_tensor(value) and not key.endswith("_extra_state"):
                        left.append(f"layer {idx} {key}")
                    continue
                shards[name].setdefault(tp, per_group(name, value, m) if in_thirds else value)
    shapes = {(n, tp): tuple(v.shape) for n, by_tp in shards.items() for tp, v in by_tp.items()}
    return merge(shards, m), shapes, left


def merge(shards: dict[str, dict[int, torch.Tensor]], m) -> dict[str, torch.Tensor]:
    return {n: mapping.merge_tp(n, [by_tp[r] for r in sorted(by_tp)], m.swiglu)
            for n, by_tp in shards.items()}


def module_params(files: TagFiles, by_index: dict, first: int, last: int, holds_tied: bool,
                  tp: int = 0, buffers=(), seen: dict | None = None) -> list[tuple[str, tuple]]:
    """A stage module's (parameter name, shape) in its order for the layer files [first, last]
    (tensor rank `tp`'s shapes): the tied embedding first where the stage holds it (the first
    stage's EmbeddingPipe, the last stage's head: DeepSpeed builds the tied module on both).
    `seen`: the layer files' (key, shape) read so far, by (index, tensor rank)."""
    seen = {} if seen is None else seen
    emb = next((i for i, r in by_index.items() if r[0] == EMBEDDING), None)
    tied = holds_tied and emb is not None
    out = []
    for idx in ([emb] if tied else []) + [i for i in sorted(files.layers)
                                          if first <= i <= last and not (tied and i == emb)]:
        prefix = "tied_modules.embed." if tied and idx == emb else f"{idx}."
        if (idx, tp) not in seen:
            seen[idx, tp] = [(k, tuple(v.shape)) for k, v in
                             read_file(files.layers[idx][tp], check=False).items()
                             if torch.is_tensor(v)]
        out += [(prefix + k, shape) for k, shape in seen[idx, tp] if prefix + k not in buffers]
    return out
