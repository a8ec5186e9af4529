"""The DeepSpeed JSON's vocabulary: every key is mapped, knowingly ignored, refused, or a typo.

DeepSpeed itself ignores a top-level key it does not know, so `"gradient_cliping": 1.0` trains
without clipping. Here every key of the JSON (top level, and the sections below) must be one of:

- SUPPORTED_KEYS: mapped onto the Config (see the table in `config/ds_json/__init__.py`);
- IGNORED_KEYS: DeepSpeed settings that change nothing this engine computes (monitoring,
  profiling, I/O and checkpoint engines, communication dtypes of features we do not have): they
  are accepted and have no effect;
- REFUSED_KEYS: DeepSpeed features that would change what is trained (data curricula, sparse or
  quantized models, autocast, elastic batches, AutoTP/MoE parallelism): a one-line error, unless
  the section is switched off (`{"enabled": false}`, false, null);
- anything else: a key DeepSpeed ignores too (a top-level key, or one in "pipeline", which
  DeepSpeed copies without looking): one warning line "unknown DeepSpeed config key 'x' (did you
  mean 'y'?)", and the run goes on. `"strict": true` (or `--deepspeed_strict`, or
  initialize(strict=True)) makes it a one-line refusal. In the sections DeepSpeed validates
  itself (fp16, bf16, wandb: pydantic models that forbid extra keys) it is always a refusal.

`SECTION_KEYS` holds the keys of the sections we read (fp16, bf16, pipeline, wandb); "pipeline"
has every key DeepSpeed's pipeline engine reads, each accepted with DeepSpeed's meaning.
"""
from __future__ import annotations

import difflib

from megatron_2bw.config.ds_json.activation import ACTIVATION_KEYS
from megatron_2bw.config.ds_json.setting import fail

SUPPORTED_KEYS = (
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "optimizer", "scheduler", "fp16", "bf16", "bfloat16", "gradient_clipping", "steps_per_print",
    "wall_clock_breakdown", "wandb", "pipeline", "zero_optimization", "amp",
    "dataloader_drop_last", "prescale_gradients", "gradient_predivide_factor", "tensorboard",
    "csv_monitor", "comet", "activation_checkpointing")

IGNORED_KEYS = (
    "comms_logger", "flops_profiler", "memory_breakdown",
    "dump_state", "autotuning", "timers", "log_level", "disable_allgather", "disable_python_gc",
    "aio", "checkpoint", "datastates", "compile", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer", "communication_data_type",
    "seq_parallel_communication_data_type", "data_types",
    "use_data_before_expert_parallelism", "managed_gradient_accumulation", "vocabulary_size")

REFUSED_KEYS = {
    "torch_autocast": 'use "bf16" or "fp16" instead',
    "data_efficiency": "data sampling and routing are not implemented",
    "curriculum_learning": "data sampling is not implemented",
    "progressive_layer_drop": "layer dropping is not implemented",
    "sparse_attention": "the models use dense attention",
    "compression_training": "model compression is not implemented",
    "quantize_training": "quantized training is not implemented",
    "weight_quantization": "quantized weights are not implemented",
    "eigenvalue": "quantized training is not implemented",
    "sparse_gradients": "gradients are reduced dense",
    "elasticity": "set the batch triple directly",
    "hybrid_engine": "the RLHF hybrid engine is not implemented",
    "tensor_parallel": "use --tensor-model-parallel-size (Megatron tensor parallelism)",
    "expert_parallel": "mixture-of-experts models are not implemented",
    "gradient_allreduce_op": "gradients are averaged over replicas ('mean')",
    "nebula": "removed from DeepSpeed",
    "graph_harvesting": "removed from DeepSpeed",
}
_OFF_VALUES = {"gradient_allreduce_op": "mean"}  # the one value that is what we do anyway

SECTION_KEYS = {
    "fp16": ("enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
             "min_loss_scale", "consecutive_hysteresis", "auto_cast",
             "fp16_master_weights_and_grads"),
    "bf16": ("enabled", "immediate_grad_update", "check_overflow", "check_grad_overflow",
             "bf16_master_weights_and_grads", "bf16_optimizer_states"),
    "pipeline": ("schedule", "activation_checkpoint_interval", "stages", "partition",
                 "seed_layers", "pipe_partitioned", "grad_partitioned", "use_reentrant"),
    "wandb": ("enabled", "project", "group", "team"),
    "tensorboard": ("enabled", "output_path", "job_name"),
    "csv_monitor": ("enabled", "output_path", "job_name"),
    "comet": ("enabled", "samples_log_interval", "project", "workspace", "api_key",
              "experiment_name", "experiment_key", "online", "mode"),
    "activation_checkpointing": ACTIVATION_KEYS,
}
SECTION_KEYS["bfloat16"] = SECTION_KEYS["bf16"]


# sections DeepSpeed reads without validating their keys
IGNORING_SECTIONS = ("pipeline", "activation_checkpointing")
STRICT_KEY = "strict"                # ours: DeepSpeed ignores it as an unknown top-level key


def _unknown(key, known, where: str = "") -> str:
    close = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    place = f" in {where}" if where else ""
    return f"unknown DeepSpeed config key {key!r}{place}{hint}"


def unknown_key(key, known, where: str = "") -> None:
    """Fail with "unknown DeepSpeed config key 'x' [in where] (did you mean 'y'?)"."""
    fail(f"{_unknown(key, known, where)}: fix or remove it")


def _ignored(key, known, where: str, strict: bool, notes: list) -> None:
    """A key DeepSpeed ignores: one warning line, or with strict a refusal."""
    if strict:
        fail(f"{_unknown(key, known, where)}: fix or remove it (strict: unknown keys are errors)")
    notes.append(f"megatron-2bw: warning: {_unknown(key, known, where)}: DeepSpeed ignores it "
                 'and so does this run ("strict": true makes it an error)')


def is_strict(ds: dict, strict: bool = False) -> bool:
    value = ds.get(STRICT_KEY, False)
    if not isinstance(value, bool):
        fail(f'DeepSpeed config: "strict" must be true or false, got {value!r}')
    return strict or value


def _switched_off(key: str, value) -> bool:
    if key in _OFF_VALUES:
        return value == _OFF_VALUES[key]
    if isinstance(value, dict):
        return value.get("enabled", True) is False or not value
    return value is None or value is False


def check_keys(ds: dict, strict: bool = False) -> list[str]:
    """Every top-level key and every key of the sections in SECTION_KEYS is known; returns the
    warning lines of the unknown keys DeepSpeed ignores (none with strict: they fail)."""
    strict = is_strict(ds, strict)
    known = SUPPORTED_KEYS + IGNORED_KEYS + tuple(REFUSED_KEYS) + (STRICT_KEY,)
    notes = []
    for key, value in ds.items():
        if key in REFUSED_KEYS and not _switched_off(key, value):
            fail(f"DeepSpeed config: {key!r} is not supported by this engine "
                 f"({REFUSED_KEYS[key]}): remove it")
        if key not in known:
            _ignored(key, known, "", strict, notes)
    for section, keys in SECTION_KEYS.items():
        value = ds.get(section)
        if isinstance(value, dict):
            for key in value:
                if key in keys:
                    continue
                if section in IGNORING_SECTIONS:
                    _ignored(key, keys, section, strict, notes)
                else:
                    unknown_key(key, keys, section)
    return notes
