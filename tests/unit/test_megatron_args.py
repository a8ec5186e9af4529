"""Megatron's arguments <-> our model settings (checkpoint/megatron/common.py, export.py): the
args our export writes are accepted by our own check for every shape the project builds, a
setting that differs is named with both values and the flag that fixes it, and what our models
cannot hold exactly (BERT's LM head norm under RMSNorm / --apply-layernorm-1p) is refused in one
line, before any process group for --ckpt-format megatron."""
import pytest

from megatron_2bw.checkpoint.megatron.common import BERT_HEAD_NORM, model_problems
from megatron_2bw.checkpoint.megatron.export import megatron_args
from megatron_2bw.config import ConfigError
from test_megatron_mapping import SHAPES, cfg_of


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_our_exported_args_describe_our_model(name):
    cfg = cfg_of(name)
    args = vars(megatron_args(cfg, {"tensor": 1, "pipeline": 1, "data": 1, "world": 1}, 3))
    assert model_problems(args, cfg.model) == []


def test_a_differing_setting_names_both_values_and_the_fix():
    cfg = cfg_of("llama")
    args = vars(megatron_args(cfg, {}, 0))
    args.update(num_query_groups=4, rotary_base=500000, kv_channels=16)
    problems = model_problems(args, cfg.model)
    assert "num_query_groups 4 (this run: 2; use --group-query-attention --num-query-groups 4)" \
        in problems
    assert "rotary_base 500000.0 (this run: 10000.0; use --rotary-base 500000)" in problems
    assert "num_kv_channels 16 (this run: 8; use --kv-channels 16)" in problems


def test_a_bert_whose_lm_head_norm_megatron_changes_is_refused():
    cfg = cfg_of("bert")
    args = dict(vars(megatron_args(cfg, {}, 0)), normalization="RMSNorm")
    assert BERT_HEAD_NORM in model_problems(args, cfg.model)
    with pytest.raises(ConfigError, match="--ckpt-format megatron cannot hold this BERT exactly"):
        cfg_of("bert", ["--normalization", "RMSNorm", "--ckpt-format", "megatron"])
    cfg_of("bert", ["--ckpt-format", "megatron"])  # the plain BERT exports
