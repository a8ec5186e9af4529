"""The one config pipeline: Megatron flags (+ an optional DeepSpeed JSON) -> a frozen, validated
Config, in one pure function.

    built = build_config(args, "gpt", world_size, typed=explicit_flags(argv),
                         vocab_size=tokenizer_vocab, planner=lambda cfg: plan(cfg, topo, prof))
    built.config          # Config, validated for world_size
    built.lr_schedule     # the DeepSpeed JSON's exact scheduler, or None (the Config's Megatron one)

The steps, in order (each returns a new Config; nothing is mutated):

1. flags -> Config (`arguments.config_from_args`); the layout flags the user typed are recorded
   in `Config.fixed` (`FLAG_FIXES`: the flag and its value, e.g. "--pipeline-schedule flush");
2. --deepspeed_config JSON on top (`ds_json.merge_flags_and_ds_config`): a conflict with a typed
   flag is a one-line error naming both; what the JSON states is recorded in `Config.fixed`
   ("pipeline.schedule=flush in the DeepSpeed config"); Megatron-DeepSpeed's --zero-stage must
   equal its zero_optimization.stage, and with --deepspeed it clips by its gradient_clipping
   (config/mds_flags.py);
3. the vocabulary size the tokenizer implies (known before anything is validated);
4. --auto-plan: the planner returns a new Config, searching only what nobody fixed
   (`planner.auto.plan`); a contradiction between fixed settings names their sources;
5. --train-samples -> --train-iters (over the global batch; with a batch-size ramp Megatron's
   count, and --lr-decay-samples defaults to --train-samples: config/ramps.py);
   Megatron-DeepSpeed's --train-tokens ends the run earlier when its tokens are reached first;
6. `Config.validate(world_size)`: once, on the final config (a ramp's log line after it).
"""
from __future__ import annotations

from typing import Callable, NamedTuple

from megatron_2bw.config import Config, ConfigError, Fixed
from megatron_2bw.config.compat import notes as compat_notes
from megatron_2bw.config.flags import config_from_args
from megatron_2bw.config.mds_flags import (cap_by_tokens, deepspeed_clipping, mds_notes,
                                           zero_stage_error)
from megatron_2bw.config.schedule_flags import schedule_given
from megatron_2bw.config.ramp_checks import ramp_note
from megatron_2bw.config.ramps import train_iterations
from megatron_2bw.schedule.kinds import default_schedule, one_stage_note, schedule_kind

# typed flag -> the Config path it fixes (what --auto-plan keeps as given)
FLAG_FIXES = {
    "--tensor-model-parallel-size": "parallel.tensor",
    "--pipeline-model-parallel-size": "parallel.pipeline",
    "--data-parallel-size": "parallel.data",
    "--rank-order": "parallel.rank_order",
    "--use-tp-pp-dp-mapping": "parallel.rank_order",
    "--pipeline-partition": "parallel.partition",
    "--micro-batch-size": "batch.micro_batch_size",
    "--global-batch-size": "batch.global_batch_size",
    "--pipeline-schedule": "schedule",
    "--2bw-compensation": "schedule",  # compensates 2BW: the planner keeps the schedule
    "--2bw-grad-buffers": "schedule",  # a 2BW mode: the planner keeps the schedule
    "--recompute-activations": "model.recompute_granularity",
    "--recompute-granularity": "model.recompute_granularity",
    "--recompute-method": "model.recompute_granularity",
    "--recompute-num-layers": "model.recompute_granularity",
    "--use-distributed-optimizer": "parallel.distributed_optimizer",
    "--zero-stage": "parallel.distributed_optimizer",  # 1: the distributed optimizer
    "--checkpoint-activations": "model.recompute_granularity",  # Megatron-DeepSpeed's
    "--sequence-parallel": "parallel.sequence_parallel",
}


class BuiltConfig(NamedTuple):
    config: Config
    deepspeed: object = None  # ds_json.DeepSpeedSettings when a DeepSpeed JSON was given
    notes: tuple[str, ...] = ()  # lines for the log: what a compatibility flag does here

    @property
    def lr_schedule(self):
        """The engine's lr schedule when it is not the Config's (a DeepSpeed "scheduler")."""
        return self.deepspeed.lr_schedule if self.deepspeed is not None else None


FLAG_DESTS = {"--2bw-compensation": "compensation",  # flags whose dest is not their name
              "--2bw-grad-buffers": "grad_buffers",
              "--gpipe-microbatches-per-flush": "microbatches_per_flush"}


def _typed_value(args, flag: str) -> str:
    value = getattr(args, FLAG_DESTS.get(flag, flag[2:].replace("-", "_")), None)
    if isinstance(value, tuple):  # --pipeline-partition, as typed
        value = ",".join(str(v) for v in value)
    return flag if value is True else f"{flag} {value}"


def fixed_by_flags(args, typed) -> tuple[Fixed, ...]:
    """Fixed entries for the layout flags in `typed` (normalized '--name's)."""
    out = []
    for flag, path in FLAG_FIXES.items():
        if flag in typed:
            out.append(Fixed(path, _typed_value(args, flag), None))
    return tuple(out)


def build_config(args, family: str, world_size: int, typed=(), vocab_size: int | None = None,
                 planner: Callable[[Config], Config] | None = None,
                 eod: int | None = None, checkpoint=None) -> BuiltConfig:
    """The validated Config of a pretrain run (see the module docstring for the steps). `args`:
    the parsed flags (`pretrain.build_parser`); `typed`: the flags given on the command line
    (`ds_json.explicit_flags(argv)`); `vocab_size`: the tokenizer's padded vocabulary (None:
    --vocab-size); `planner`: --auto-plan's Config -> Config; `eod`: the tokenizer's
    end-of-document id (--eod-mask-loss); `checkpoint`: (where, its saved Config.to_dict()) for
    --use-checkpoint-args. Raises ConfigError (one line)."""
    typed = set(typed)
    _check_sample_mode(args)
    cfg = config_from_args(args, family)
    notes = list(compat_notes(args)) + mds_notes(args)
    cfg = cfg.replace(fixed=tuple(f._replace(value=cfg.get(f.path))
                                  for f in fixed_by_flags(args, typed)))
    deepspeed = None
    if getattr(args, "deepspeed_config", None):
        from megatron_2bw.config.ds_json import load_ds_json, merge_flags_and_ds_config
        ds_json = load_ds_json(args.deepspeed_config)
        error = zero_stage_error(args, ds_json)  # Megatron-DeepSpeed's --zero-stage
        if error:
            raise ConfigError(error)
        cfg, deepspeed = merge_flags_and_ds_config(cfg, typed, ds_json, world_size,
                                                   layout_free=planner is not None)
        notes += deepspeed.notes   # unknown keys DeepSpeed ignores: one warning line each
        cfg, line = deepspeed_clipping(cfg, args, ds_json)  # with --deepspeed: the JSON's
        notes += [line] if line else []
    if vocab_size is not None:
        cfg = cfg.replace(model={"vocab_size": vocab_size})
    if eod is not None and (cfg.model.eod_mask_loss or cfg.model.reset_position_ids
                            or cfg.model.reset_attention_mask):
        cfg = cfg.replace(model={"eod_token": int(eod)})  # the tokenizer's end of document
    if checkpoint is not None:
        cfg, line = _checkpoint_model(cfg, *checkpoint)
        notes.append(line)
    explicit = schedule_given(args) or any(f.path == "schedule" for f in cfg.fixed)
    if not explicit:  # the stage count may come from the DeepSpeed JSON
        cfg = cfg.replace(schedule=default_schedule(cfg.parallel.pipeline))
    if planner is not None:
        cfg = planner(cfg)
    cfg = cfg.resolved(world_size)
    notes += _one_stage_lines(cfg, explicit, planned=planner is not None)
    if cfg.parallel.sequence_parallel and cfg.parallel.tensor == 1:  # Megatron's behaviour
        notes.append("megatron-2bw: warning: --sequence-parallel needs "
                     "--tensor-model-parallel-size > 1: turned off (t = 1)")
        cfg = cfg.replace(parallel={"sequence_parallel": False})
    samples = getattr(args, "train_samples", None)
    if samples is not None:
        if samples < 1:
            raise ConfigError(f"--train-samples must be >= 1, got {samples}")
        b = cfg.batch
        if b.rampup_batch_size or b.step_batch_size_schedule:  # Megatron's count, lr in samples
            cfg = cfg.replace(train={"train_iters": max(1, train_iterations(
                b, cfg.model.seq_length, samples))})
            if cfg.optimizer.lr_decay_samples is None:
                cfg = cfg.replace(optimizer={"lr_decay_samples": samples})
        else:
            cfg = cfg.replace(train={"train_iters": max(1, -(-samples // cfg.global_batch_size))})
    cfg, line = cap_by_tokens(cfg, args, world_size)  # Megatron-DeepSpeed's --train-tokens
    notes += [line] if line else []
    cfg = cfg.validate(world_size)
    if deepspeed is None or deepspeed.lr_schedule is None:  # the Megatron schedule drives
        from megatron_2bw.config.checks import megatron_lr_problem
        problem = megatron_lr_problem(cfg.optimizer)
        if problem:
            raise ConfigError(problem)
    note = ramp_note(cfg)
    return BuiltConfig(cfg, deepspeed, tuple(notes + [note] if note else notes))


def _one_stage_lines(cfg: Config, explicit: bool, planned: bool) -> list[str]:
    """With one pipeline stage: the line saying the default schedule is synchronous, or the
    kind's warning when a schedule that delays the gradient was asked for."""
    d = cfg.parallel.pipeline
    if explicit:
        warning = schedule_kind(cfg.schedule).one_stage_warning(d)
        return [warning] if warning else []
    if d == 1 and not planned:
        return [one_stage_note(d)]
    return []


# the model settings --use-checkpoint-args takes from a checkpoint (Megatron's list, in our names)
CHECKPOINT_ARGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                   "seq_length", "max_position_embeddings", "vocab_size",
                   "position_embedding_type", "rotary_base", "rotary_percent", "normalization",
                   "layernorm_epsilon", "swiglu", "group_query_attention", "num_query_groups",
                   "num_kv_channels", "add_bias_linear", "openai_gelu",
                   "untie_embeddings_and_output_weights", "apply_layernorm_1p", "qk_layernorm")


def _checkpoint_model(cfg: Config, where: str, saved: dict) -> tuple[Config, str]:
    """--use-checkpoint-args: cfg with the checkpoint's model settings, and the log line."""
    from megatron_2bw.config import ConfigError
    model = saved.get("model") or {}
    if model.get("family", cfg.model.family) != cfg.model.family:
        raise ConfigError(f"--use-checkpoint-args: {where} holds a {model['family']} model, "
                          f"this script trains a {cfg.model.family}")
    taken = {k: model[k] for k in CHECKPOINT_ARGS if k in model}
    changed = {k: v for k, v in taken.items() if getattr(cfg.model, k) != v}
    shown = ", ".join(f"{k} {v}" for k, v in changed.items()) or "the same as the flags"
    return (cfg.replace(model=taken),
            f"megatron-2bw: --use-checkpoint-args: the model's settings from {where}: {shown}")


def _check_sample_mode(args) -> None:
    """Megatron's rule: iteration-based runs (--train-iters) take iteration-based lr flags,
    sample-based runs (--train-samples) sample-based ones."""
    from megatron_2bw.config import ConfigError
    if getattr(args, "train_samples", None) is not None:
        bad = [f for f, v in (("--lr-decay-iters", getattr(args, "lr_decay_iters", None)),
                              ("--lr-warmup-iters", getattr(args, "lr_warmup_iters", 0))) if v]
        if bad:
            raise ConfigError(f"--train-samples counts samples: use --lr-decay-samples / "
                              f"--lr-warmup-samples (or --lr-warmup-fraction) instead of "
                              f"{' and '.join(bad)}")
    else:
        bad = [f for f, v in (("--lr-decay-samples", getattr(args, "lr_decay_samples", None)),
                              ("--lr-warmup-samples", getattr(args, "lr_warmup_samples", 0)))
               if v]
        if bad:
            raise ConfigError(f"{' and '.join(bad)} count samples: give --train-samples, or "
                              "use --lr-decay-iters / --lr-warmup-iters with --train-iters")

