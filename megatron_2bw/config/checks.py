"""The rules of `Config.validate` (schema.py): every check that needs no process group, each a
one-line ConfigError naming the setting and the fix; `check_config` runs them on a resolved
config."""
from __future__ import annotations

import importlib.util
import shutil
import sys

from megatron_2bw.config.choices import (CKPT_FORMATS, GRAD_ACCUMULATIONS, LR_DECAY_STYLES,
                                         MODEL_FAMILIES, OPTIMIZERS, PRECISIONS, RANK_ORDERS,
                                         RECOMPUTE_GRANULARITIES, RECOMPUTE_METHODS, SCHEDULES,
                                         ConfigError)
from megatron_2bw.config.mds_flags import check_lr_tokens
from megatron_2bw.config.ramp_checks import ramp_error
from megatron_2bw.config.numbers import NOT_FINITE, nonfinite_fields
from megatron_2bw.schedule.compensation_methods import compensation_error
from megatron_2bw.schedule.kinds import schedule_kind, schedule_kind_of


def check_config(cfg: Config, world_size: int | None) -> Config:
    """Config.validate's rules, on the resolved config `cfg`: ConfigError (one line) for the
    first bad setting, else `cfg`."""
    m, p, b, o, pr = cfg.model, cfg.parallel, cfg.batch, cfg.optimizer, cfg.precision
    bad = nonfinite_fields(cfg)  # first: NaN passes every comparison below (config/numbers.py)
    if bad:
        _fail("; ".join(f"{flag} {NOT_FINITE}, got {value}" for flag, value in bad))
    if cfg.schedule not in SCHEDULES:
        _fail(f"unknown pipeline schedule {cfg.schedule!r}: use one of {', '.join(SCHEDULES)} "
              "(--pipeline-schedule)")
    for name, value in (("--tensor-model-parallel-size", p.tensor),
                        ("--pipeline-model-parallel-size", p.pipeline)):
        if value < 1:
            _fail(f"{name} must be >= 1, got {value}")
    if p.data is not None and p.data < 1:
        _fail(f"--data-parallel-size must be >= 1, got {p.data}")
    if world_size is not None:
        model_parallel = p.tensor * p.pipeline
        if world_size % model_parallel != 0:
            _fail(f"world size {world_size} is not divisible by tensor x pipeline = "
                  f"{p.tensor} x {p.pipeline} = {model_parallel}: launch a multiple of "
                  f"{model_parallel} processes or change the parallel sizes")
        w = cfg.data_parallel_size
        if p.tensor * p.pipeline * w != world_size:
            _fail(f"world size {world_size} != tensor x pipeline x data = {p.tensor} x "
                  f"{p.pipeline} x {w}: launch {p.tensor * p.pipeline * w} processes or "
                  "change the parallel sizes")
    if p.rank_order not in RANK_ORDERS:
        _fail(f"unknown rank order {p.rank_order!r}: use one of {', '.join(RANK_ORDERS)}")
    if p.timeout_minutes <= 0:
        _fail(f"--distributed-timeout-minutes must be > 0, got {p.timeout_minutes}")
    if p.grad_bucket_size is not None and p.grad_bucket_size < 1:
        _fail(f"--ddp-bucket-size must be a positive number of parameters per bucket, got "
              f"{p.grad_bucket_size}: drop it for Megatron's default, max(40M, 1M x w)")
    for name, value in (("--num-layers", m.num_layers), ("--hidden-size", m.hidden_size),
                        ("--num-attention-heads", m.num_attention_heads),
                        ("--seq-length", m.seq_length), ("vocab size", m.vocab_size),
                        ("--micro-batch-size", b.micro_batch_size),
                        ("--global-batch-size", b.global_batch_size),
                        ("--train-iters", cfg.train.train_iters),
                        ("--log-interval", cfg.train.log_interval)):
        if value < 1:
            _fail(f"{name} must be >= 1, got {value}")
    for name, value in (("--ffn-hidden-size", m.ffn_hidden_size),
                        ("--max-position-embeddings", m.max_position_embeddings)):
        if value is not None and value < 1:
            _fail(f"{name} must be >= 1 (or unset for the default), got {value}")
    if m.num_kv_channels is not None and m.num_kv_channels < 1:
        _fail(f"--kv-channels must be >= 1, got {m.num_kv_channels}")
    if m.num_kv_channels is None and m.hidden_size % m.num_attention_heads != 0:
        _fail(f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads "
              f"{m.num_attention_heads}: pick a head count that divides the hidden size")
    if m.num_attention_heads % p.tensor != 0:
        _fail(f"--num-attention-heads {m.num_attention_heads} is not divisible by "
              f"--tensor-model-parallel-size {p.tensor}")
    if m.max_positions < m.seq_length:
        _fail(f"--max-position-embeddings {m.max_positions} < --seq-length {m.seq_length}: "
              "raise --max-position-embeddings")
    if m.family not in MODEL_FAMILIES:
        _fail(f"unknown model family {m.family!r}: use one of {', '.join(MODEL_FAMILIES)}")
    if m.vocab_size % p.tensor != 0:
        _fail(f"vocabulary size {m.vocab_size} is not divisible by "
              f"--tensor-model-parallel-size {p.tensor}: pad it with "
              "--make-vocab-size-divisible-by")
    if p.partition is not None:
        bounds, n = p.partition, m.num_layers + 2
        if (len(bounds) != p.pipeline + 1 or bounds[0] != 0 or bounds[-1] != n
                or any(x >= y for x, y in zip(bounds, bounds[1:]))):
            _fail(f"stage partition {bounds} must rise strictly from 0 to {n} in "
                  f"{p.pipeline} steps (one boundary per stage)")
    if m.recompute_granularity not in (None,) + RECOMPUTE_GRANULARITIES:
        _fail(f"unknown --recompute-granularity {m.recompute_granularity!r}: use one of "
              f"{', '.join(RECOMPUTE_GRANULARITIES)}")
    if m.full_recompute and m.recompute_method is None:
        _fail("--recompute-granularity full needs --recompute-method {uniform,block} (and "
              "--recompute-num-layers N, default 1)")
    if m.selective_recompute and m.recompute_method is not None:
        _fail("--recompute-method applies to --recompute-granularity full, not selective: "
              "drop one of them")
    if p.sequence_parallel:  # at t = 1 the config pipeline turns it off (build.py), as Megatron
        if m.seq_length % p.tensor:
            _fail(f"--sequence-parallel needs --seq-length {m.seq_length} divisible by "
                  f"--tensor-model-parallel-size {p.tensor}")
    if m.recompute_method is not None:
        if m.recompute_method not in RECOMPUTE_METHODS:
            _fail(f"unknown --recompute-method {m.recompute_method!r}: use one of "
                  f"{', '.join(RECOMPUTE_METHODS)}")
        if m.recompute_num_layers < 1:
            _fail(f"--recompute-num-layers must be >= 1 with --recompute-method, got "
                  f"{m.recompute_num_layers}")
        # Megatron's bounds: block recomputes the first N layers of each stage, uniform
        # groups the layers into chunks of N
        per_stage = m.num_layers // max(p.pipeline, 1)
        most, what = ((per_stage, f"the {per_stage} layers per pipeline stage")
                      if m.recompute_method == "block" else
                      (m.num_layers, f"--num-layers {m.num_layers}"))
        if most >= 1 and m.recompute_num_layers > most:
            _fail(f"--recompute-num-layers {m.recompute_num_layers} is more than {what} "
                  f"(--recompute-method {m.recompute_method}): use at most {most}")
    _check_architecture(m, p)
    if p.pipeline > m.num_layers:
        _fail(f"--pipeline-model-parallel-size {p.pipeline} is larger than --num-layers "
              f"{m.num_layers}: every stage needs at least one transformer layer")
    check_dropouts(m)
    w = cfg.data_parallel_size
    if b.rampup_batch_size or b.step_batch_size_schedule or b.decrease_batch_size_if_needed:
        error = ramp_error(cfg)  # every batch of the ramp the run reaches (ramp_checks.py)
    elif b.global_batch_size % (b.micro_batch_size * w) != 0:
        error = (f"--global-batch-size {b.global_batch_size} is not divisible by "
                 f"--micro-batch-size x data-parallel size = {b.micro_batch_size} x {w}: "
                 f"use a multiple of {b.micro_batch_size * w}")
    else:
        kind = schedule_kind(cfg.schedule)
        low = kind.min_microbatches(p.pipeline)
        error = kind.microbatch_error(
            p.pipeline, cfg.num_microbatches,
            f"raise --global-batch-size to at least {low * b.micro_batch_size * w} or lower "
            "--micro-batch-size")
    if error:
        _fail(error)
    error = compensation_error(cfg.compensation, cfg.schedule, o.name, o.sgd_momentum)
    if error:
        _fail(error)
    try:
        schedule_kind_of(cfg.schedule, cfg.grad_buffers, cfg.microbatches_per_flush)
    except ValueError as e:
        _fail(str(e))
    tr = cfg.train
    for name, value in (("--eval-interval", tr.eval_interval),
                        ("--save-interval", tr.save_interval),
                        ("--keep-last", tr.keep_last),
                        ("--exit-interval", tr.exit_interval),
                        ("--exit-duration-in-mins", tr.exit_duration_in_mins),
                        ("--num-workers", tr.num_workers or 0)):
        if value < 0:
            _fail(f"{name} must be >= 0, got {value}")
    if tr.skip_train and tr.eval_iters < 1:
        _fail(f"--skip-train evaluates --eval-iters batches and trains none: give --eval-iters "
              f">= 1, got {tr.eval_iters}")
    if tr.eval_interval and tr.eval_iters < 1:
        _fail(f"--eval-iters must be >= 1 with --eval-interval, got {tr.eval_iters}")
    if tr.save_interval and not tr.save:
        _fail("--save-interval needs --save DIR: say where checkpoints go")
    if tr.ckpt_format not in CKPT_FORMATS:
        _fail(f"unknown --ckpt-format {tr.ckpt_format!r}: use one of "
              f"{', '.join(CKPT_FORMATS)}")
    if tr.ckpt_format == "megatron" and m.family == "bert" and (
            m.normalization != "LayerNorm" or m.apply_layernorm_1p):
        _fail("--ckpt-format megatron cannot hold this BERT exactly: Megatron's BERT LM head "
              "norm follows --normalization and --apply-layernorm-1p, this project's is a plain "
              "LayerNorm: save with --ckpt-format torch_dist")
    if tr.async_save and tr.ckpt_format not in ("torch_dist", "megatron"):
        _fail(f"--async-save needs --ckpt-format torch_dist or megatron (the {tr.ckpt_format} "
              "format is "
              "written synchronously): drop one of them")
    if tr.async_save and not tr.save:
        _fail("--async-save needs --save DIR: say where checkpoints go")
    _check_observability(tr, world_size)
    if o.name not in OPTIMIZERS:
        _fail(f"unknown optimizer {o.name!r}: use one of {', '.join(OPTIMIZERS)}")
    error = (optimizer_impl_error(o.impl, o.name, "cuda" if p.backend == "nccl" else None)
             or _kernel_missing(o.impl))
    if error:
        _fail(error)
    if o.lr < 0 or o.min_lr < 0:
        _fail(f"learning rates must be >= 0, got --lr {o.lr} --min-lr {o.min_lr}")
    for flag, value in (("--decoupled-lr", o.decoupled_lr),
                        ("--decoupled-min-lr", o.decoupled_min_lr)):
        if value is not None and value < 0:
            _fail(f"{flag} must be >= 0, got {value}")
    if o.clip_grad < 0:
        _fail(f"--clip-grad must be >= 0 (0 disables clipping), got {o.clip_grad}")
    if o.weight_decay < 0:
        _fail(f"--weight-decay must be >= 0, got {o.weight_decay}")
    for flag, value in (("--adam-eps", o.adam_eps), ("--sgd-momentum", o.sgd_momentum),
                        ("--init-method-std", m.init_method_std)):
        if value < 0:  # torch.optim's and torch.nn.init's own rules, checked before they run
            _fail(f"{flag} must be >= 0, got {value}")
    if o.lr_decay_iters is not None and o.lr_decay_iters < 1:
        _fail(f"--lr-decay-iters must be >= 1 (or unset: --train-iters), got {o.lr_decay_iters}")
    if not (0 <= o.adam_beta1 < 1 and 0 <= o.adam_beta2 < 1):
        _fail(f"--adam-beta1/--adam-beta2 must be in [0, 1), got {o.adam_beta1}, "
              f"{o.adam_beta2}")
    if o.lr_decay_style not in LR_DECAY_STYLES:
        _fail(f"unknown --lr-decay-style {o.lr_decay_style!r}: use one of "
              f"{', '.join(LR_DECAY_STYLES)}")
    if o.lr_warmup_iters < 0:
        _fail(f"--lr-warmup-iters must be >= 0, got {o.lr_warmup_iters}")
    if not o.lr_warmup_init >= 0:
        _fail(f"--lr-warmup-init must be >= 0, got {o.lr_warmup_init}")
    _check_lr_samples(o)
    tokens_error = check_lr_tokens(cfg)  # Megatron-DeepSpeed's token-based lr (mds_flags.py)
    if tokens_error:
        _fail(tokens_error)
    if pr.dtype not in PRECISIONS:
        _fail(f"unknown precision {pr.dtype!r}: use one of {', '.join(PRECISIONS)}")
    if pr.loss_scale is not None and pr.loss_scale <= 0:
        _fail(f"--loss-scale must be > 0, got {pr.loss_scale}")
    if pr.initial_loss_scale <= 0:
        _fail(f"--initial-loss-scale must be > 0, got {pr.initial_loss_scale}")
    if pr.min_loss_scale <= 0:
        _fail(f"--min-loss-scale must be > 0, got {pr.min_loss_scale}")
    if pr.dtype == "fp16" and pr.loss_scale is None:  # Megatron's DynamicGradScaler asserts
        if pr.min_loss_scale > pr.initial_loss_scale:
            _fail(f"--min-loss-scale {pr.min_loss_scale:g} is above --initial-loss-scale "
                  f"{pr.initial_loss_scale:g}: lower it")
        for flag, value in (("--loss-scale-window", pr.loss_scale_window),
                            ("--hysteresis", pr.hysteresis)):
            if value < 1:
                _fail(f"{flag} must be >= 1, got {value}")
    if pr.max_skipped_steps is not None and pr.max_skipped_steps < 0:
        _fail(f"--max-skipped-steps must be >= 0 (0: no limit), got {pr.max_skipped_steps}")
    if pr.grad_accumulation not in GRAD_ACCUMULATIONS:
        _fail(f"unknown --grad-accumulation {pr.grad_accumulation!r}: use one of "
              f"{', '.join(GRAD_ACCUMULATIONS)}")
    if pr.grad_accumulation == "buffer" and pr.dtype == "fp32":
        _fail("--grad-accumulation buffer keeps a bf16/fp16 gradient buffer, and fp32 runs "
              "accumulate in fp32 already: add --bf16 or --fp16, or drop the flag")
    return cfg


# --optimizer-impl: which kernel steps the flat optimizer (optim/kernels.py implements them)
OPTIMIZER_IMPLS = ("auto", "native", "torch-fused", "apex", "unfused")
ADAM_ONLY_IMPLS = ("native", "apex")
# what a machine may lack for a kernel: config probes for it (`_kernel_missing`), optim/kernels.py
# finds it when the kernel does not load
IMPL_MISSING = {
    "native": "--optimizer-impl native builds a C kernel on first use (optim/native.py) and no C "
              "compiler (cc or gcc on PATH) built one here: install one or use --optimizer-impl "
              "auto",
    "apex": "--optimizer-impl apex needs NVIDIA apex with its CUDA extensions (amp_C), not "
            "importable here: install apex or use --optimizer-impl auto",
}


def optimizer_impl_error(impl: str, optimizer: str, device_type: str | None = None) -> str | None:
    """A one-line error when kernel `impl` cannot step `optimizer` ("adam", "sgd") on a
    `device_type` device (None: not known yet), else None. What the machine lacks
    (`IMPL_MISSING`) the caller probes."""
    if impl not in OPTIMIZER_IMPLS:
        return f"unknown --optimizer-impl {impl!r}: use one of {', '.join(OPTIMIZER_IMPLS)}"
    if impl in ADAM_ONLY_IMPLS and optimizer != "adam":
        return (f"--optimizer-impl {impl} is an Adam kernel, not one for --optimizer "
                f"{optimizer}: use --optimizer-impl auto")
    if impl == "native" and device_type not in (None, "cpu"):
        return (f"--optimizer-impl native is a CPU kernel and this run steps on {device_type}: "
                "use --optimizer-impl auto (or --distributed-backend gloo)")
    return None


def _kernel_missing(impl: str) -> str | None:
    """IMPL_MISSING's line when this machine visibly lacks what kernel `impl` needs."""
    if impl == "native" and not (shutil.which("cc") or shutil.which("gcc")):
        return IMPL_MISSING[impl]
    if impl == "apex" and "amp_C" not in sys.modules and importlib.util.find_spec("amp_C") is None:
        return IMPL_MISSING[impl]
    return None


def megatron_lr_problem(o: OptimizerConfig) -> str | None:
    """What Megatron's OptimizerParamScheduler asserts of --min-lr and --lr-warmup-init (the
    Megatron schedule's rule: config/build.py asks it unless a DeepSpeed "scheduler" drives the
    lr, whose WarmupLR may warm up downwards)."""
    for flag, value in (("--min-lr", o.min_lr), ("--lr-warmup-init", o.lr_warmup_init)):
        if value > o.lr:
            return f"{flag} {value:g} is above --lr {o.lr:g}: lower it or raise --lr"
    return None


def check_dropouts(m: ModelConfig, error=None) -> None:
    """--hidden-dropout and --attention-dropout in [0, 1) (`error(message)` raises: ConfigError
    by default; tools/plan.py raises its PlanError)."""
    for name, value in (("--hidden-dropout", m.hidden_dropout),
                        ("--attention-dropout", m.attention_dropout)):
        if not 0.0 <= value < 1.0:
            (error or _fail)(f"{name} must be in [0, 1), got {value}")


def _fail(message: str):
    raise ConfigError(message)


def _check_lr_samples(o) -> None:
    """Megatron's rules of the fraction and sample-based lr flags."""
    if o.lr_warmup_fraction is not None:
        if not 0 <= o.lr_warmup_fraction <= 1:
            _fail(f"--lr-warmup-fraction must be in [0, 1], got {o.lr_warmup_fraction}")
        if o.lr_warmup_iters or o.lr_warmup_samples:
            _fail("--lr-warmup-fraction excludes --lr-warmup-iters and --lr-warmup-samples: "
                  "give one warmup")
    if o.lr_warmup_samples < 0 or (o.lr_decay_samples is not None and o.lr_decay_samples < 1):
        _fail(f"--lr-warmup-samples must be >= 0 and --lr-decay-samples >= 1, got "
              f"{o.lr_warmup_samples}, {o.lr_decay_samples}")


def _check_observability(tr: TrainConfig, world_size: int | None) -> None:
    """The rules of the logging, profiling and straggler flags (one-line errors)."""
    if tr.log_timers_to_tensorboard and not tr.tensorboard_dir:
        _fail("--log-timers-to-tensorboard needs --tensorboard-dir DIR: say where events go")
    if tr.tensorboard_log_interval < 1:
        _fail(f"--tensorboard-log-interval must be >= 1, got {tr.tensorboard_log_interval}")
    if tr.tensorboard_queue_size < 1:
        _fail(f"--tensorboard-queue-size must be >= 1, got {tr.tensorboard_queue_size}")
    if tr.profile:
        if not 0 <= tr.profile_step_start < tr.profile_step_end:
            _fail(f"--profile-step-start {tr.profile_step_start} / --profile-step-end "
                  f"{tr.profile_step_end}: need 0 <= start < end (the iterations after start up "
                  "to end are profiled)")
        bad = [r for r in tr.profile_ranks if r < 0 or (world_size and r >= world_size)]
        if bad or not tr.profile_ranks:
            _fail(f"--profile-ranks {' '.join(map(str, tr.profile_ranks))}: each must be a rank "
                  f"of the world (0..{(world_size or 1) - 1})")
    if not tr.straggler_threshold > 0:
        _fail(f"--straggler-threshold must be > 0 (percent above the median), got "
              f"{tr.straggler_threshold}")


POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")


def _check_architecture(m: ModelConfig, p: ParallelConfig) -> None:
    """The rules of the architecture flags (one block, one-line errors)."""
    if m.position_embedding_type not in POSITION_EMBEDDING_TYPES:
        _fail(f"unknown --position-embedding-type {m.position_embedding_type!r}: use one of "
              f"{', '.join(POSITION_EMBEDDING_TYPES)}")
    if m.normalization not in NORMALIZATIONS:
        _fail(f"unknown --normalization {m.normalization!r}: use one of "
              f"{', '.join(NORMALIZATIONS)}")
    if not m.layernorm_epsilon > 0:
        _fail(f"--norm-epsilon must be > 0, got {m.layernorm_epsilon}")
    if m.position_embedding_type == "rope":
        if not 0 < m.rotary_percent <= 1:
            _fail(f"--rotary-percent must be in (0, 1], got {m.rotary_percent}")
        if m.rotary_dim < 2 or m.rotary_dim % 2:
            _fail(f"--rotary-percent {m.rotary_percent} rotates {m.rotary_dim} of the "
                  f"{m.kv_channels} channels per head: RoPE needs an even number >= 2")
        if not m.rotary_base > 0:
            _fail(f"--rotary-base must be > 0, got {m.rotary_base}")
    if m.group_query_attention:
        g = m.num_query_groups
        if g < 1 or m.num_attention_heads % g:
            _fail(f"--num-query-groups {g} must divide --num-attention-heads "
                  f"{m.num_attention_heads} (each group shares one key/value head)")
        if g % p.tensor:
            _fail(f"--num-query-groups {g} is not divisible by --tensor-model-parallel-size "
                  f"{p.tensor}: every tensor rank holds whole query groups; use a multiple of "
                  f"{p.tensor} groups or a smaller tensor size")
    if m.eod_mask_loss and (m.family != "gpt" or m.eod_token is None):
        _fail("--eod-mask-loss needs a GPT and a tokenizer with an end-of-document id "
              "(--tokenizer-type ...): --mock-data without one has no documents to end"
              if m.family == "gpt" else "--eod-mask-loss is a GPT flag: drop it for BERT")
    if m.reset_position_ids and (m.family != "gpt" or m.eod_token is None):
        _fail("--reset-position-ids needs a GPT and a tokenizer with an end-of-document id "
              "(--tokenizer-type ...)")  # with RoPE it is accepted: no effect (config/compat.py)
    if m.reset_attention_mask and (m.family != "gpt" or m.eod_token is None):
        _fail("--reset-attention-mask needs a GPT and a tokenizer with an end-of-document id "
              "(--tokenizer-type ...): --mock-data without one has no documents to end"
              if m.family == "gpt" else "--reset-attention-mask is a GPT flag: drop it for BERT")
    if m.qk_layernorm and p.tensor > 1 and not p.sequence_parallel:
        _fail("--qk-layernorm at --tensor-model-parallel-size > 1 needs --sequence-parallel "
              "here (its norms' gradients are summed over the tensor ranks with the "
              "sequence-parallel ones)")
    if m.openai_gelu and m.swiglu:
        _fail("--openai-gelu and --swiglu exclude each other: SwiGLU's activation is SiLU")
    if m.ffn_size < 1:
        _fail(f"--swiglu's default ffn size int(8h/3 / 64) * 64 is 0 for --hidden-size "
              f"{m.hidden_size}: give --ffn-hidden-size")
    if m.ffn_size % p.tensor:
        _fail(f"the ffn size {m.ffn_size} is not divisible by --tensor-model-parallel-size "
              f"{p.tensor}: change --ffn-hidden-size")
