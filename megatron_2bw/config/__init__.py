"""The one typed config and its two front doors.

Owns: the frozen dataclasses (schema.py), the settings' vocabularies and `ConfigError`
(choices.py), every rule that needs no process group (checks.py), the one pipeline from flags
and DeepSpeed JSON to a validated Config (build.py), Megatron's command line (flags.py; logging
flags: log_flags.py; architecture flags: architecture_flags.py; the flags of Megatron's scripts
taken for compatibility, stated or refused: compat.py, Megatron-DeepSpeed's: compat_mds.py, and
those with a meaning of their own: mds_flags.py; an unknown flag's did-you-mean: suggest.py;
batch-size ramps, Megatron's num-microbatches arithmetic: ramps.py, their
refusals: ramp_checks.py), the directories a run writes into (config/paths.py),
whether the loggers' packages import (packages.py), the DeepSpeed JSON (ds_json/), "a number is
finite where a number is meant" for every front door (numbers.py: float flags, JSON numbers,
Config floats), reading a user's input file inside a one-line error (input_files.py), the named
model shapes of `--model` (flavours.py), the control flags' names (control_flags.py) and the
rank and world the launcher's variables give (launcher_env.py).
Must not import: parallel, data, tensor_parallel, models, optim, pipeline, checkpoint, training,
planner, deepspeed, testing, pretrain, generate.
A config is built and validated before anything runs: it reads only the names it checks from
their owners (schedule/kinds.py, schedule/compensation_methods.py) and the launcher's
environment (launcher_env.py), never an engine, a process group or a file of data (the
files it reads for the other packages, input_files.py, it reads where they ask).

    from megatron_2bw.config import Config, ConfigError, ModelConfig
"""
from megatron_2bw.config.choices import (CKPT_FORMATS, LR_DECAY_STYLES, MODEL_FAMILIES, OPTIMIZERS,
                                         PRECISIONS, RANK_ORDERS, RECOMPUTE_GRANULARITIES,
                                         RECOMPUTE_METHODS, SCHEDULES, ConfigError)
from megatron_2bw.config.schema import (BatchConfig, Config, Fixed, ModelConfig, OptimizerConfig,
                                        ParallelConfig, PrecisionConfig, TrainConfig,
                                        num_microbatches)

__all__ = ["BatchConfig", "CKPT_FORMATS", "Config", "ConfigError", "Fixed", "LR_DECAY_STYLES",
           "MODEL_FAMILIES", "ModelConfig", "OPTIMIZERS", "OptimizerConfig", "PRECISIONS",
           "ParallelConfig", "PrecisionConfig", "RANK_ORDERS", "RECOMPUTE_GRANULARITIES",
           "RECOMPUTE_METHODS", "SCHEDULES", "TrainConfig", "num_microbatches"]
