"""Megatron-DeepSpeed's flags with a meaning here (deepspeedai/Megatron-DeepSpeed, its
megatron/arguments.py and examples_deepspeed/*.sh), folded into Megatron-LM's terms on the parsed
flags before the config is built (`fold_mds_args`, run by the parser):

    Megatron-DeepSpeed                       here
    --num-key-value-heads N                  --group-query-attention --num-query-groups N (N equal
                                             to the heads: plain attention; `mds_model`)
    --use-rotary-position-embeddings         --position-embedding-type rope
    --rotary-position-embeddings-theta T     --rotary-base T
    --checkpoint-activations                 --recompute-granularity full --recompute-method
      [--checkpoint-num-layers N (1)]        uniform --recompute-num-layers N
    --zero-stage S                           0: nothing; 1: --use-distributed-optimizer (ZeRO-1:
                                             optimizer state and fp32 master weights sharded);
                                             with --deepspeed_config it must equal the JSON's
                                             zero_optimization.stage (`zero_stage_error`);
                                             2 and 3 are refused
    --train-tokens T                         the run stops after the first iteration whose
                                             consumed tokens (samples x --seq-length) reach T,
                                             or at --train-iters / --train-samples, whichever
                                             comes first (`cap_by_tokens`)
    --lr-warmup-tokens, --lr-decay-tokens    warmup and decay in tokens, Megatron-DeepSpeed's
                                             arithmetic (optim/lr.py)
    --no-pipeline-parallel                   one stage (refused with more, as it asserts)

(--normalization's and --layernorm-epsilon's spellings are flags.py's; the selectors and the
features the engine lacks are compat_mds.py's.) Where Megatron-LM and Megatron-DeepSpeed
disagree, Megatron-DeepSpeed's meaning is taken with --deepspeed, and without it too, stated in
one line (a flag Megatron-LM retired: --checkpoint-activations, --data-impl). With --deepspeed
and a DeepSpeed JSON, gradient clipping is the JSON's gradient_clipping (absent: none), as
Megatron-DeepSpeed hands the optimizer to DeepSpeed unclipped (`deepspeed_clipping`).
"""
from __future__ import annotations

import argparse
import dataclasses

from megatron_2bw.config.choices import ConfigError


def add_mds_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Megatron-DeepSpeed's flags (config/mds_flags.py)")
    g.add_argument("--num-key-value-heads", type=int, default=None,
                   help="grouped-query attention with N key/value heads (= --group-query-"
                        "attention --num-query-groups N; N = the heads: plain attention)")
    g.add_argument("--use-rotary-position-embeddings", action="store_true",
                   help="RoPE (= --position-embedding-type rope)")
    g.add_argument("--rotary-position-embeddings-theta", dest="rope_theta", type=int,
                   default=None, help="RoPE's base (= --rotary-base)")
    g.add_argument("--checkpoint-activations", action="store_true",
                   help="recompute every transformer layer in backward, in chunks of "
                        "--checkpoint-num-layers (= --recompute-granularity full "
                        "--recompute-method uniform --recompute-num-layers N)")
    g.add_argument("--checkpoint-num-layers", type=int, default=None,
                   help="the chunk of --checkpoint-activations (1)")
    g.add_argument("--zero-stage", type=int, default=None,
                   help="0: no sharding; 1: the distributed optimizer (DeepSpeed's ZeRO-1); "
                        "must equal the DeepSpeed config's zero_optimization.stage")
    g.add_argument("--train-tokens", type=int, default=None,
                   help="stop once this many tokens (samples x --seq-length) are trained, or at "
                        "--train-iters / --train-samples, whichever comes first")
    g.add_argument("--lr-warmup-tokens", type=int, default=None,
                   help="warm the lr up over this many tokens (Megatron-DeepSpeed's)")
    g.add_argument("--lr-decay-tokens", type=int, default=None,
                   help="decay the lr over this many tokens (Megatron-DeepSpeed's)")
    g.add_argument("--no-pipeline-parallel", action="store_true",
                   help="Megatron-DeepSpeed without DeepSpeed's pipeline: one stage")


def fold_mds_args(args: argparse.Namespace) -> list[str]:
    """Set the Megatron-LM flags the Megatron-DeepSpeed ones mean (in place); returns the
    refusals, one line each, for the parser's one message."""
    out = []
    if getattr(args, "use_rotary_position_embeddings", False):
        if getattr(args, "position_embedding_type", None) not in (None, "rope"):
            out.append("--use-rotary-position-embeddings (RoPE) with --position-embedding-type "
                       f"{args.position_embedding_type}: give one of them")
        else:
            args.position_embedding_type = "rope"
    theta = getattr(args, "rope_theta", None)
    if theta is not None:
        if getattr(args, "rotary_base", None) not in (None, float(theta)):
            out.append(f"--rotary-position-embeddings-theta {theta} with --rotary-base "
                       f"{args.rotary_base:g}: give one of them")
        else:
            args.rotary_base = float(theta)
    heads = getattr(args, "num_key_value_heads", None)
    if heads is not None:
        if heads < 1:
            out.append(f"--num-key-value-heads must be >= 1, got {heads}")
        elif getattr(args, "num_query_groups", None) not in (None, heads):
            out.append(f"--num-key-value-heads {heads} with --num-query-groups "
                       f"{args.num_query_groups}: give one of them")
    out += _fold_recompute(args)
    stage = getattr(args, "zero_stage", None)
    if stage is not None:
        if stage in (2, 3):
            out.append(f"--zero-stage {stage}: ZeRO stage {stage} (gradients"
                       f"{' and parameters' if stage == 3 else ''} partitioned) is not in this "
                       "engine, and DeepSpeed refuses it with pipeline parallelism: use "
                       "--zero-stage 1 (the distributed optimizer)")
        elif stage not in (0, 1):
            out.append(f"--zero-stage must be 0 or 1, got {stage}")
        elif stage == 1:
            args.use_distributed_optimizer = True
    stages = getattr(args, "pipeline_model_parallel_size", 1)
    if getattr(args, "no_pipeline_parallel", False) and stages > 1:
        out.append("--no-pipeline-parallel needs --pipeline-model-parallel-size 1 (as in "
                   f"Megatron-DeepSpeed): drop it to train {stages} stages")
    for flag in ("train_tokens", "lr_warmup_tokens", "lr_decay_tokens"):
        value = getattr(args, flag, None)
        if value is not None and value < (0 if flag == "lr_warmup_tokens" else 1):
            out.append(f"--{flag.replace('_', '-')} must be >= "
                       f"{0 if flag == 'lr_warmup_tokens' else 1}, got {value}")
    return out


def _fold_recompute(args) -> list[str]:
    """--checkpoint-activations: full recomputation in uniform chunks of --checkpoint-num-layers
    (Megatron-DeepSpeed's transformer tests it before --recompute-granularity)."""
    n = getattr(args, "checkpoint_num_layers", None)
    if n is not None and n < 1:
        return [f"--checkpoint-num-layers must be >= 1, got {n}"]
    if not getattr(args, "checkpoint_activations", False):
        return []
    n = n or 1
    given = (args.recompute_granularity, args.recompute_method, args.recompute_num_layers)
    if args.recompute_activations or given not in ((None, None, None), ("full", "uniform", None),
                                                   ("full", "uniform", n)):
        return [f"--checkpoint-activations (--recompute-granularity full --recompute-method "
                f"uniform --recompute-num-layers {n}) with other recompute flags: give one of "
                "them"]
    args.recompute_granularity, args.recompute_method = "full", "uniform"
    args.recompute_num_layers = n
    return []


def mds_model(model, args):
    """The ModelConfig with --num-key-value-heads applied (the heads are known by now)."""
    heads = getattr(args, "num_key_value_heads", None)
    if heads is None or (heads == model.num_attention_heads
                         and not getattr(args, "group_query_attention", None)):
        return model
    return dataclasses.replace(model, group_query_attention=True, num_query_groups=heads)


def mds_notes(args: argparse.Namespace) -> list[str]:
    """One line per Megatron-DeepSpeed flag given: what it means here."""
    out = []
    retired = "" if getattr(args, "deepspeed", False) else "; Megatron-LM retired the flag"
    if getattr(args, "checkpoint_activations", False):
        n = args.recompute_num_layers
        out.append(f"--checkpoint-activations: every transformer layer recomputed in backward, "
                   f"in chunks of {n} (Megatron-DeepSpeed's meaning: --recompute-granularity "
                   f"full --recompute-method uniform --recompute-num-layers {n}){retired}")
    elif getattr(args, "checkpoint_num_layers", None) is not None:
        out.append("--checkpoint-num-layers: no effect without --checkpoint-activations, as in "
                   "Megatron-DeepSpeed")
    if getattr(args, "use_rotary_position_embeddings", False):
        out.append("--use-rotary-position-embeddings: RoPE (= --position-embedding-type rope)")
    if getattr(args, "num_key_value_heads", None) is not None:
        out.append(f"--num-key-value-heads {args.num_key_value_heads}: grouped-query attention "
                   f"(= --group-query-attention --num-query-groups {args.num_key_value_heads})")
    if getattr(args, "zero_stage", None) in (0, 1):
        out.append(f"--zero-stage {args.zero_stage}: " + (
            "no sharding" if args.zero_stage == 0 else "the distributed optimizer (ZeRO-1: "
            "optimizer state and fp32 master weights sharded over the data-parallel ranks)"))
    if getattr(args, "no_pipeline_parallel", False):
        out.append("--no-pipeline-parallel: one pipeline stage, as given")
    return [f"megatron-2bw: {line}" for line in out]


def zero_stage_error(args, ds_json) -> str | None:
    """--zero-stage against the DeepSpeed JSON's zero_optimization.stage (DeepSpeed's default
    0), or None when they agree (or either is absent)."""
    stage = getattr(args, "zero_stage", None)
    if stage is None or ds_json is None:
        return None
    zero = ds_json.get("zero_optimization") or {}
    json_stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    if json_stage == stage:
        return None
    said = "zero_optimization.stage" if "stage" in zero else \
        "zero_optimization.stage (absent: DeepSpeed's default)"
    return (f"--zero-stage {stage} disagrees with the DeepSpeed config's {said} {json_stage}: "
            "give the same stage in both")


def deepspeed_clipping(cfg, args, ds_json):
    """(cfg, note): with --deepspeed and a DeepSpeed JSON without gradient_clipping, no clipping,
    as in Megatron-DeepSpeed (DeepSpeed clips, by its JSON; --clip-grad is Megatron's optimizer's,
    which it does not use then)."""
    if not (getattr(args, "deepspeed", False) and ds_json is not None) \
            or "gradient_clipping" in ds_json or not cfg.optimizer.clip_grad:
        return cfg, None
    note = (f"megatron-2bw: --clip-grad {cfg.optimizer.clip_grad:g}: no effect with --deepspeed, "
            "as in Megatron-DeepSpeed (DeepSpeed clips by the DeepSpeed config's "
            f"gradient_clipping, absent there: no clipping); add \"gradient_clipping\": "
            f"{cfg.optimizer.clip_grad:g} to it to clip")
    return cfg.replace(optimizer={"clip_grad": 0.0}), note


def cap_by_tokens(cfg, args, world_size: int | None = None):
    """(cfg, note): --train-tokens T ends the run after the first iteration whose consumed tokens
    reach T (Megatron-DeepSpeed's loop: while consumed tokens < T), or at the iterations given,
    whichever comes first; the lr's default decay span stays the one given (--train-iters or
    --train-samples), as there. Consumed tokens are consumed samples x seq length: with a
    batch-size ramp the plan's (the config resolved for `world_size` knows it)."""
    tokens = getattr(args, "train_tokens", None)
    if tokens is None:
        return cfg, None
    seq, iters = cfg.model.seq_length, cfg.train.train_iters
    b = cfg.batch
    per = ""  # tokens per iteration, when the batch does not ramp
    if b.rampup_batch_size or b.step_batch_size_schedule:
        consumed = cfg.validate(world_size).batch_plan.consumed
    else:
        consumed = lambda k: k * cfg.global_batch_size  # noqa: E731
        per = f" of {cfg.global_batch_size * seq} per iteration"
    by_tokens = 1
    while by_tokens < iters and consumed(by_tokens) * seq < tokens:
        by_tokens += 1
    if consumed(by_tokens) * seq < tokens or by_tokens >= iters:
        return cfg, (f"megatron-2bw: --train-tokens {tokens}: not reached in the {iters} "
                     f"iterations given ({consumed(iters) * seq} tokens)")
    o = cfg.optimizer
    if o.lr_decay_iters is None and o.lr_decay_samples is None:
        samples = getattr(args, "train_samples", None)
        cfg = cfg.replace(optimizer={"lr_decay_samples": samples} if samples is not None
                          else {"lr_decay_iters": iters})
    return cfg.replace(train={"train_iters": by_tokens}), (
        f"megatron-2bw: --train-tokens {tokens}: the run stops after iteration {by_tokens} "
        f"({consumed(by_tokens) * seq} tokens{per}), before the {iters} iterations given")


def check_lr_tokens(cfg) -> str | None:
    """Megatron-DeepSpeed's decay in tokens counts from the warmup's end in tokens: without
    --lr-warmup-tokens that end is the tokens consumed when the warmup's last iteration began,
    so the warmup must be whole iterations (else its scheduler fails: None - tokens)."""
    o, batch = cfg.optimizer, cfg.global_batch_size
    if o.lr_decay_tokens is None or o.lr_warmup_tokens is not None:
        return None
    if o.lr_warmup_fraction is not None:
        decay = o.lr_decay_samples if o.lr_decay_samples is not None else \
            (o.lr_decay_iters or cfg.train.train_iters) * batch
        warmup = o.lr_warmup_fraction * decay
    else:
        warmup = o.lr_warmup_samples or o.lr_warmup_iters * batch
    if warmup <= 0 or warmup % batch:
        return ("--lr-decay-tokens counts from the warmup's end in tokens: give --lr-warmup-"
                "tokens (0 for no warmup), or a warmup of whole iterations (--lr-warmup-iters "
                f"N, or --lr-warmup-samples a multiple of the global batch {batch})")
    return None
