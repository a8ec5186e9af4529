"""What a checkpoint was saved for: the model and the parallel layout (`layout`), and the one
check that a saved layout holds this run's model (`check_layout`; a torch_dist checkpoint may
change only the parallel keys, a torch one nothing).

The model keys are every setting that changes what the saved tensors mean or which tensors there
are: the shapes, the vocabulary, tied embeddings, positions (learned, or RoPE with its base and
percent), the norm (LayerNorm/RMSNorm, --apply-layernorm-1p's gamma - 1, --qk-layernorm), the
MLP (SwiGLU, or GeLU's exact or --openai-gelu's tanh form), query groups, --kv-channels, linear biases
and BERT's binary head. A key that means nothing for the model is None (RoPE's base for learned
positions), so changing it does not refuse a resume. Numerical settings that leave the tensors'
meaning alone (--norm-epsilon, dropout, initialization) are not recorded: a resume may change
them.

Checkpoints written before a key was recorded lack it. Their rule (`saved_layout`): the value
the config they saved holds (each checkpoint keeps `Config.to_dict()`, the settings its model
code built with), else the setting's default (a config without the field was written by code
that knew no other value).
"""
from __future__ import annotations

import dataclasses

from megatron_2bw.checkpoint.files import CheckpointError
from megatron_2bw.checkpoint.megatron.common import setting_flag
from megatron_2bw.checkpoint.torch_format import legacy_layout
from megatron_2bw.config import (BatchConfig, Config, ModelConfig, OptimizerConfig,
                                 ParallelConfig, PrecisionConfig, TrainConfig)


def model_layout(m: ModelConfig) -> dict:
    """The model keys of `layout` (module docstring)."""
    learned = m.position_embedding_type == "learned_absolute"
    rope = m.position_embedding_type == "rope"
    return {"family": m.family, "num_layers": m.num_layers, "hidden_size": m.hidden_size,
            "num_attention_heads": m.num_attention_heads, "ffn_size": m.ffn_size,
            "vocab_size": m.vocab_size, "max_positions": m.max_positions if learned else None,
            "tied": not m.untie_embeddings_and_output_weights,
            "position_embedding_type": m.position_embedding_type,
            "normalization": m.normalization, "swiglu": m.swiglu,
            "query_groups": m.query_groups, "bias_linear": m.add_bias_linear,
            "kv_channels": m.kv_channels,
            "rotary_base": m.rotary_base if rope else None,
            "rotary_percent": m.rotary_percent if rope else None,
            "apply_layernorm_1p": m.apply_layernorm_1p, "qk_layernorm": m.qk_layernorm,
            "openai_gelu": m.openai_gelu,
            "bert_binary_head": m.bert_binary_head if m.family == "bert" else None}


def layout(cfg: Config, grid) -> dict:
    """What a checkpoint of `cfg` saved by `grid` (anything with .tensor and .pipeline, e.g.
    cfg.parallel) is for."""
    return {**model_layout(cfg.model), "tensor": grid.tensor, "pipeline": grid.pipeline}


PARALLEL_KEYS = ("tensor", "pipeline")  # layout() entries a torch_dist checkpoint may change
MODEL_KEYS = tuple(model_layout(ModelConfig()))
# layout keys named otherwise as ModelConfig fields (megatron/common.setting_flag spells a field's
# flag; "tied" is the inverse of its field)
_FIELD = {"ffn_size": "ffn_hidden_size", "max_positions": "max_position_embeddings",
          "tied": "untie_embeddings_and_output_weights", "query_groups": "num_query_groups",
          "bias_linear": "add_bias_linear", "kv_channels": "num_kv_channels"}


def config_from_dict(d: dict) -> Config:
    """The Config a checkpoint recorded (`Config.to_dict()`); unknown keys are ignored, absent
    ones take their defaults."""
    parts = {"model": ModelConfig, "parallel": ParallelConfig, "batch": BatchConfig,
             "optimizer": OptimizerConfig, "precision": PrecisionConfig, "train": TrainConfig}
    kwargs = {}
    for key, cls in parts.items():
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs[key] = cls(**{k: v for k, v in (d.get(key) or {}).items() if k in known})
    return Config(schedule=d.get("schedule", Config().schedule), **kwargs)


def saved_layout(record: dict) -> dict:
    """The layout a checkpoint's record (common.pt, a torch stage file's payload, our Megatron
    export's own record: each holds "layout" and "config") was saved for, with the keys it lacks
    from the config it saved (module docstring)."""
    theirs = legacy_layout(dict(record.get("layout") or {}))
    missing = [k for k in MODEL_KEYS if k not in theirs]
    if not missing:
        return theirs
    model = dict((record.get("config") or {}).get("model") or {})
    model.update({k: theirs[k] for k in ("family", "num_layers", "hidden_size",
                                         "num_attention_heads", "vocab_size") if k in theirs})
    derived = model_layout(config_from_dict({"model": model}).model)
    return {**theirs, **{k: derived[k] for k in missing}}


def _diff(theirs: dict, ours: dict, keys) -> list[str]:
    return [f"{k} {theirs.get(k)} != {ours[k]}" for k in keys if theirs.get(k) != ours[k]]


def _flags(theirs: dict, ours: dict, keys) -> str:
    """The flags that give the checkpoint's settings where they differ (", "-joined)."""
    out = []
    for k in keys:
        value = theirs.get(k)
        if value == ours[k] or value is None or k == "vocab_size":  # vocabulary: the tokenizer
            continue
        flag = setting_flag(_FIELD.get(k, k), not value if k == "tied" else value)
        if flag:
            out.append(flag)
    return ", ".join(out)


def check_layout(theirs: dict, cfg: Config, grid, what: str, resharding: bool) -> None:
    """One-line CheckpointError when a saved layout (`saved_layout`) holds another model (or,
    when it cannot be resharded, another parallel layout) than this run's: both values of each
    difference and the flags that match the checkpoint."""
    ours = layout(cfg, grid)
    theirs = legacy_layout(theirs)
    keys = [k for k in ours if not (resharding and k in PARALLEL_KEYS)]
    diff = _diff(theirs, ours, keys)
    if not diff:
        return
    flags = _flags(theirs, ours, keys)
    fix = f"use matching flags ({flags})" if flags else "use matching flags"
    if not resharding and not _diff(theirs, ours, [k for k in ours if k not in PARALLEL_KEYS]):
        fix += (", or convert it with tools/checkpoint_convert.py to-dist to load it into any "
                "layout")
    raise CheckpointError(f"checkpoint {what} was saved for another model "
                          f"{'' if resharding else 'or layout '}({', '.join(diff)}): {fix}")


def common_parallel(cfg: Config, grid) -> dict:
    return {"tensor": grid.tensor, "pipeline": grid.pipeline, "data": grid.data,
            "world": grid.world_size, "schedule": cfg.schedule, "compensation": cfg.compensation}
