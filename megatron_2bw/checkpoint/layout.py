"""What a checkpoint was saved for: the model and the parallel layout (`layout`), and the one
check that a saved layout holds this run's model (`check_layout`; a torch_dist checkpoint may
change only the parallel keys, a torch one nothing)."""
from __future__ import annotations

from megatron_2bw.checkpoint.files import CheckpointError
from megatron_2bw.checkpoint.torch_format import legacy_layout
from megatron_2bw.config import Config


def layout(cfg: Config, grid) -> dict:
    m = cfg.model
    learned = m.position_embedding_type == "learned_absolute"
    return {"family": m.family, "num_layers": m.num_layers, "hidden_size": m.hidden_size,
            "num_attention_heads": m.num_attention_heads, "ffn_size": m.ffn_size,
            "vocab_size": m.vocab_size, "max_positions": m.max_positions if learned else None,
            "tied": not m.untie_embeddings_and_output_weights,
            "position_embedding_type": m.position_embedding_type,
            "normalization": m.normalization, "swiglu": m.swiglu,
            "query_groups": m.query_groups, "bias_linear": m.add_bias_linear,
            "tensor": grid.tensor, "pipeline": grid.pipeline}


PARALLEL_KEYS = ("tensor", "pipeline")  # layout() entries a torch_dist checkpoint may change


def _diff(theirs: dict, ours: dict, keys) -> list[str]:
    return [f"{k} {theirs.get(k)} != {ours[k]}" for k in keys if theirs.get(k) != ours[k]]


def check_layout(theirs: dict, cfg: Config, grid, what: str, resharding: bool) -> None:
    """One-line CheckpointError when a saved layout holds another model (or, when it cannot be
    resharded, another parallel layout) than this run's."""
    ours = layout(cfg, grid)
    keys = [k for k in ours if not (resharding and k in PARALLEL_KEYS)]
    diff = _diff(legacy_layout(theirs), ours, keys)
    if not diff:
        return
    fix = "use matching flags"
    if not resharding and not _diff(legacy_layout(theirs), ours,
                                    [k for k in ours if k not in PARALLEL_KEYS]):
        fix += (", or convert it with tools/checkpoint_convert.py to-dist to load it into any "
                "layout")
    raise CheckpointError(f"checkpoint {what} was saved for another model "
                          f"{'' if resharding else 'or layout '}({', '.join(diff)}): {fix}")


def common_parallel(cfg: Config, grid) -> dict:
    return {"tensor": grid.tensor, "pipeline": grid.pipeline, "data": grid.data,
            "world": grid.world_size, "schedule": cfg.schedule, "compensation": cfg.compensation}
