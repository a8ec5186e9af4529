"""The one typed config and its two front doors.

Owns: the frozen dataclasses (schema.py), the settings' vocabularies and `ConfigError`
(choices.py), every rule that needs no process group (checks.py), the one pipeline from flags
and DeepSpeed JSON to a validated Config (build.py), Megatron's command line (flags.py), the
directories a run writes into (config/paths.py) and the DeepSpeed JSON (ds_json/).
Must not import: pipeline.engine, models, parallel, optim, checkpoint, training, planner,
deepspeed, testing (a config is built and validated before anything runs).

    from megatron_2bw.config import Config, ConfigError, ModelConfig
"""
from megatron_2bw.config.choices import (CKPT_FORMATS, LR_DECAY_STYLES, MODEL_FAMILIES,
                                         OPTIMIZERS, PRECISIONS, RANK_ORDERS,
                                         RECOMPUTE_GRANULARITIES, RECOMPUTE_METHODS, SCHEDULES,
                                         ConfigError)
from megatron_2bw.config.schema import (BatchConfig, Config, Fixed, ModelConfig, OptimizerConfig,
                                        ParallelConfig, PrecisionConfig, TrainConfig,
                                        num_microbatches)

__all__ = ["BatchConfig", "CKPT_FORMATS", "Config", "ConfigError", "Fixed", "LR_DECAY_STYLES",
           "MODEL_FAMILIES", "ModelConfig", "OPTIMIZERS", "OptimizerConfig", "PRECISIONS",
           "ParallelConfig", "PrecisionConfig", "RANK_ORDERS", "RECOMPUTE_GRANULARITIES",
           "RECOMPUTE_METHODS", "SCHEDULES", "TrainConfig", "num_microbatches"]
