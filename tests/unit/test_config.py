"""Config.validate: every bad setting raises ConfigError with one line naming the setting; the
config is frozen, validate never mutates, and m / w are properties of the resolved config."""
import dataclasses

import pytest

from megatron_2bw.config import (BatchConfig, Config, ConfigError, ModelConfig, OptimizerConfig,
                                 ParallelConfig, PrecisionConfig, TrainConfig)


def make(schedule="2bw", model=None, parallel=None, batch=None, optimizer=None, precision=None,
         train=None):
    """A config that is valid for world size 1 apart from the overridden fields."""
    return Config(model=ModelConfig(**(model or {})),
                  parallel=ParallelConfig(**(parallel or {})),
                  batch=BatchConfig(**(batch or {})),
                  optimizer=OptimizerConfig(**(optimizer or {})),
                  precision=PrecisionConfig(**(precision or {})),
                  train=TrainConfig(**(train or {})),
                  schedule=schedule)


# (id, config, world size, key words the message must contain)
BAD = [
    ("world-ne-t*d*w-explicit-data",
     make(parallel=dict(pipeline=2, data=2), model=dict(num_layers=2),
          batch=dict(global_batch_size=4)),
     6, ["world size 6", "data"]),
    ("world-ne-t*d*w-explicit-data-too-big",
     make(parallel=dict(tensor=2, pipeline=1, data=4), batch=dict(global_batch_size=4)),
     4, ["world size 4", "tensor", "pipeline", "data"]),
    ("world-not-divisible-by-t*d",
     make(parallel=dict(pipeline=2), batch=dict(global_batch_size=4)),
     3, ["world size 3", "not divisible", "pipeline"]),
    ("world-not-divisible-by-t*d-tensor",
     make(parallel=dict(tensor=2, pipeline=2), batch=dict(global_batch_size=4)),
     6, ["world size 6", "not divisible", "tensor"]),
    ("global-batch-not-divisible-by-micro*w",
     make(batch=dict(micro_batch_size=2, global_batch_size=6)),
     2, ["--global-batch-size", "--micro-batch-size"]),
    ("global-batch-not-divisible-by-micro",
     make(batch=dict(micro_batch_size=4, global_batch_size=6), schedule="flush"),
     1, ["--global-batch-size", "--micro-batch-size"]),
    ("2bw-m-lt-d",
     make(parallel=dict(pipeline=4), model=dict(num_layers=4), batch=dict(global_batch_size=3)),
     4, ["2bw", "microbatches", "--global-batch-size"]),
    ("2bw-m-lt-d-with-dp",
     make(parallel=dict(pipeline=2), model=dict(num_layers=2),
          batch=dict(micro_batch_size=2, global_batch_size=4)),
     4, ["2bw", "m=1 < d=2", "--global-batch-size"]),
    ("more-stages-than-layers",
     make(parallel=dict(pipeline=4), model=dict(num_layers=2), batch=dict(global_batch_size=4)),
     4, ["--pipeline-model-parallel-size", "--num-layers"]),
    ("unknown-schedule", make(schedule="1f1b"), 1, ["--pipeline-schedule", "1f1b"]),
    ("hidden-not-divisible-by-heads",
     make(model=dict(hidden_size=66, num_attention_heads=4)),
     1, ["--hidden-size", "--num-attention-heads"]),
    ("heads-not-divisible-by-tensor",
     make(model=dict(hidden_size=60, num_attention_heads=4), parallel=dict(tensor=3)),
     3, ["--num-attention-heads", "--tensor-model-parallel-size"]),
    ("negative-lr", make(optimizer=dict(lr=-1e-3)), 1, ["--lr"]),
    ("negative-min-lr", make(optimizer=dict(min_lr=-1.0)), 1, ["--min-lr"]),
    ("negative-clip", make(optimizer=dict(clip_grad=-0.5)), 1, ["--clip-grad"]),
    ("unknown-optimizer", make(optimizer=dict(name="lamb")), 1, ["optimizer", "lamb"]),
    ("unknown-precision", make(precision=dict(dtype="fp8")), 1, ["precision", "fp8"]),
    ("unknown-rank-order", make(parallel=dict(rank_order="pp-dp-tp")), 1,
     ["rank order", "pp-dp-tp"]),
    ("hidden-dropout-1", make(model=dict(hidden_dropout=1.0)), 1, ["--hidden-dropout"]),
    ("attention-dropout-negative", make(model=dict(attention_dropout=-0.1)), 1,
     ["--attention-dropout"]),
    ("max-positions-lt-seq-length",
     make(model=dict(seq_length=64, max_position_embeddings=32)),
     1, ["--max-position-embeddings", "--seq-length"]),
    ("negative-ffn-hidden-size", make(model=dict(ffn_hidden_size=-5)), 1, ["--ffn-hidden-size"]),
    ("zero-max-positions", make(model=dict(max_position_embeddings=0)), 1,
     ["--max-position-embeddings"]),
    ("zero-train-iters", make(train=dict(train_iters=0)), 1, ["--train-iters"]),
    ("zero-log-interval", make(train=dict(log_interval=0)), 1, ["--log-interval"]),
    ("zero-loss-scale", make(precision=dict(dtype="fp16", loss_scale=0.0)), 1, ["--loss-scale"]),
    ("negative-loss-scale", make(precision=dict(dtype="fp16", loss_scale=-8.0)), 1,
     ["--loss-scale"]),
    ("zero-initial-loss-scale", make(precision=dict(dtype="fp16", initial_loss_scale=0.0)), 1,
     ["--initial-loss-scale"]),
    ("unknown-lr-decay-style", make(optimizer=dict(lr_decay_style="exponential")), 1,
     ["--lr-decay-style", "exponential"]),
    ("zero-global-batch", make(batch=dict(global_batch_size=0)), 1, ["--global-batch-size"]),
    ("zero-micro-batch", make(batch=dict(micro_batch_size=0)), 1, ["--micro-batch-size"]),
    ("zero-pipeline", make(parallel=dict(pipeline=0)), None, ["--pipeline-model-parallel-size"]),
    ("zero-data", make(parallel=dict(data=0)), None, ["--data-parallel-size"]),
    ("zero-timeout", make(parallel=dict(timeout_minutes=0)), 1, ["--distributed-timeout-minutes"]),
    ("negative-weight-decay", make(optimizer=dict(weight_decay=-0.1)), 1, ["--weight-decay"]),
    ("adam-beta-1", make(optimizer=dict(adam_beta2=1.0)), 1, ["--adam-beta2"]),
    ("negative-warmup", make(optimizer=dict(lr_warmup_iters=-1)), 1, ["--lr-warmup-iters"]),
    ("recompute-uniform-more-layers-than-the-model",
     make(model=dict(num_layers=2, recompute_method="uniform", recompute_num_layers=5)), 1,
     ["--recompute-num-layers 5", "--num-layers 2", "at most 2"]),
    ("recompute-block-more-layers-than-a-stage",
     make(parallel=dict(pipeline=2), model=dict(num_layers=4, recompute_method="block",
                                                recompute_num_layers=3),
          batch=dict(global_batch_size=2)), 2,
     ["--recompute-num-layers 3", "2 layers per pipeline stage", "at most 2"]),
]


@pytest.mark.parametrize("cfg,world,words", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_config_raises_one_line(cfg, world, words):
    with pytest.raises(ConfigError) as info:
        cfg.validate(world)
    msg = str(info.value)
    assert msg.strip(), "empty message"
    assert "\n" not in msg and "\r" not in msg, f"message is not one line: {msg!r}"
    for word in words:
        assert word in msg, f"{word!r} not in {msg!r}"


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


# (id, config, world size, expected data-parallel size, expected microbatches)
GOOD = [
    ("defaults-world-none", make(), None, 1, 1),
    ("defaults-world-1", make(), 1, 1, 1),
    ("readme-main-job",
     make(parallel=dict(pipeline=2), model=dict(num_layers=4),
          batch=dict(micro_batch_size=4, global_batch_size=32)), 2, 1, 8),
    ("derived-data",
     make(parallel=dict(pipeline=2), model=dict(num_layers=4),
          batch=dict(micro_batch_size=2, global_batch_size=16)), 8, 4, 2),
    ("explicit-data",
     make(parallel=dict(pipeline=2, data=2), model=dict(num_layers=4),
          batch=dict(micro_batch_size=2, global_batch_size=16)), 4, 2, 4),
    ("tensor-pipeline-data",
     make(parallel=dict(tensor=2, pipeline=2), model=dict(num_layers=4),
          batch=dict(micro_batch_size=1, global_batch_size=8)), 8, 2, 4),
    ("2bw-m-eq-d",
     make(parallel=dict(pipeline=4), model=dict(num_layers=4), batch=dict(global_batch_size=4)),
     4, 1, 4),
    ("flush-m-lt-d",
     make(schedule="flush", parallel=dict(pipeline=4), model=dict(num_layers=4),
          batch=dict(global_batch_size=1)), 4, 1, 1),
    ("gpipe-m-lt-d",
     make(schedule="gpipe", parallel=dict(pipeline=4), model=dict(num_layers=4),
          batch=dict(micro_batch_size=2, global_batch_size=4)), 4, 1, 2),
    ("flush-m-lt-d-with-dp",
     make(schedule="flush", parallel=dict(pipeline=2), model=dict(num_layers=2),
          batch=dict(micro_batch_size=2, global_batch_size=4)), 4, 2, 1),
    ("fp16-dynamic", make(precision=dict(dtype="fp16")), 1, 1, 1),
    ("bf16-sgd-cosine",
     make(precision=dict(dtype="bf16"),
          optimizer=dict(name="sgd", lr_decay_style="cosine", clip_grad=0.0)), 1, 1, 1),
    ("tp-pp-dp-order", make(parallel=dict(rank_order="tp-pp-dp")), 1, 1, 1),
    ("max-positions-gt-seq", make(model=dict(max_position_embeddings=128)), 1, 1, 1),
    ("recompute-uniform-all-layers",
     make(model=dict(num_layers=2, recompute_method="uniform", recompute_num_layers=2)), 1, 1, 1),
    ("recompute-block-all-layers-of-a-stage",
     make(parallel=dict(pipeline=2), model=dict(num_layers=4, recompute_method="block",
                                                recompute_num_layers=2),
          batch=dict(global_batch_size=2)), 2, 1, 2),
]


@pytest.mark.parametrize("cfg,world,w,m", [c[1:] for c in GOOD], ids=[c[0] for c in GOOD])
def test_valid_config(cfg, world, w, m):
    before = cfg.to_dict()
    out = cfg.validate(world)
    assert cfg.to_dict() == before  # validate returns the resolved config, never mutates
    assert out.data_parallel_size == w and out.parallel.data == (w if world else cfg.parallel.data)
    assert out.num_microbatches == m
    assert out.batch.global_batch_size == out.batch.micro_batch_size * m * w
    assert out.validate(world) == out  # resolving is idempotent
    if world is not None:
        assert cfg.parallel.tensor * cfg.parallel.pipeline * w == world


def test_config_is_frozen_and_replace_makes_a_new_one():
    cfg = make(parallel=dict(pipeline=2), model=dict(num_layers=4))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.batch.micro_batch_size = 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.schedule = "flush"
    new = cfg.replace(schedule="flush", batch={"micro_batch_size": 4},
                      **{"optimizer.lr": 0.5, "batch.global_batch_size": 8})
    assert (new.schedule, new.batch.micro_batch_size, new.batch.global_batch_size,
            new.optimizer.lr) == ("flush", 4, 8, 0.5)
    assert (cfg.schedule, cfg.batch.micro_batch_size, cfg.optimizer.lr) == ("2bw", 1, 1e-3)
    assert new.parallel is cfg.parallel and new.get("optimizer.lr") == 0.5
    assert make(parallel=dict(partition=[0, 2, 4])).parallel.partition == (0, 2, 4)


def test_fixed_sources_are_metadata_not_settings():
    from megatron_2bw.config import Fixed
    cfg = make()
    tagged = cfg.replace(fixed=(Fixed("schedule", "--pipeline-schedule 2bw", "2bw"),))
    assert tagged == cfg and tagged.to_dict() == cfg.to_dict()
    assert tagged.source_of("schedule") == "--pipeline-schedule 2bw"
    assert tagged.source_of("parallel.pipeline") is None and cfg.source_of("schedule") is None


def test_m_is_asked_of_the_config_alone():
    """m = B / (b x w) is computed in config/schema.py only: the engine, the data and the DeepSpeed
    front door ask `Config.num_microbatches` (the planner's enumeration calls the same
    function)."""
    import ast
    import os
    root = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), "megatron_2bw")
    found = []
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            if not name.endswith(".py") or path.endswith(os.path.join("megatron_2bw", "config",
                                                                      "schema.py")):
                continue
            for node in ast.walk(ast.parse(open(path).read())):
                if isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv):
                    text = ast.unparse(node)
                    if "global_batch" in text and "micro" in text:
                        found.append(f"{path}:{node.lineno}: {text}")
    assert not found, found


def test_2bw_same_layout_as_flush_rejected_only_for_2bw():
    """The m < d rule is 2BW's alone: the same layout is fine for flush and gpipe."""
    kw = dict(parallel=dict(pipeline=4), model=dict(num_layers=4), batch=dict(global_batch_size=2))
    with pytest.raises(ConfigError):
        make("2bw", **kw).validate(4)
    for schedule in ("flush", "gpipe"):
        make(schedule, **kw).validate(4)


def test_to_dict_round_trips_sizes():
    d = make(parallel=dict(pipeline=2)).to_dict()
    assert d["parallel"]["pipeline"] == 2 and d["schedule"] == "2bw"
