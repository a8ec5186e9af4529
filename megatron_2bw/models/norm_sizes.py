"""Sizes of the normalization layers (no torch: the planner's cost model imports them without
loading torch; models/norms.py builds the layers and re-exports these)."""
from __future__ import annotations

from megatron_2bw.config import ModelConfig


def norm_params(cfg: ModelConfig) -> int:
    """Parameters of one normalization layer (models/flops.py counts with it)."""
    return cfg.hidden_size * (1 if cfg.normalization == "RMSNorm" else 2)


def norm_stats_bytes(cfg: ModelConfig, tokens: int) -> int:
    """fp32 statistics one normalization layer keeps for the backward: LayerNorm's mean and
    1/std, RMSNorm's 1/rms (the input is counted by the caller)."""
    return tokens * (4 if cfg.normalization == "RMSNorm" else 8)
