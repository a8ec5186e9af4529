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
- anything else: a one-line "unknown DeepSpeed config key 'x' (did you mean 'y'?)".

`SECTION_KEYS` is the same for the sections we read (fp16, bf16, pipeline, wandb).
"""
from __future__ import annotations

import difflib

from megatron_2bw.config.ds_json.setting import fail

SUPPORTED_KEYS = (
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "optimizer", "scheduler", "fp16", "bf16", "bfloat16", "gradient_clipping", "steps_per_print",
    "wall_clock_breakdown", "wandb", "pipeline", "zero_optimization", "amp",
    "dataloader_drop_last", "prescale_gradients", "gradient_predivide_factor")

IGNORED_KEYS = (
    "tensorboard", "csv_monitor", "comet", "comms_logger", "flops_profiler", "memory_breakdown",
    "dump_state", "autotuning", "timers", "log_level", "disable_allgather", "disable_python_gc",
    "aio", "checkpoint", "datastates", "compile", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer", "communication_data_type",
    "seq_parallel_communication_data_type", "activation_checkpointing", "data_types",
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
    "bf16": ("enabled", "immediate_grad_update", "check_overflow",
             "bf16_master_weights_and_grads", "bf16_optimizer_states"),
    "pipeline": ("schedule", "activation_checkpoint_interval", "stages", "partition",
                 "seed_layers", "pipe_partitioned", "grad_partitioned"),
    "wandb": ("enabled", "project", "group", "team"),
}
SECTION_KEYS["bfloat16"] = SECTION_KEYS["bf16"]


def unknown_key(key, known, where: str = "") -> None:
    """Fail with "unknown DeepSpeed config key 'x' [in where] (did you mean 'y'?)"."""
    close = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    place = f" in {where}" if where else ""
    fail(f"unknown DeepSpeed config key {key!r}{place}{hint}: fix or remove it")


def _switched_off(key: str, value) -> bool:
    if key in _OFF_VALUES:
        return value == _OFF_VALUES[key]
    if isinstance(value, dict):
        return value.get("enabled", True) is False or not value
    return value is None or value is False


def check_keys(ds: dict) -> None:
    """Every top-level key and every key of the sections in SECTION_KEYS is known."""
    known = SUPPORTED_KEYS + IGNORED_KEYS + tuple(REFUSED_KEYS)
    for key, value in ds.items():
        if key in REFUSED_KEYS and not _switched_off(key, value):
            fail(f"DeepSpeed config: {key!r} is not supported by this engine "
                 f"({REFUSED_KEYS[key]}): remove it")
        if key not in known:
            unknown_key(key, known)
    for section, keys in SECTION_KEYS.items():
        value = ds.get(section)
        if isinstance(value, dict):
            for key in value:
                if key not in keys:
                    unknown_key(key, keys, section)
