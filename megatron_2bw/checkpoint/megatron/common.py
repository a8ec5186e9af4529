"""What a Megatron checkpoint says beside its tensors, read the way Megatron-LM's
megatron/training/checkpointing.py writes it (`generate_state_dict`, `save_checkpoint`):

    args                       argparse.Namespace of Megatron's arguments: the model
                               (`model_settings` -> our ModelConfig fields), the layout
                               (tensor/pipeline_model_parallel_size, data_parallel_size,
                               world_size), the data position (consumed_train_samples), precision
    checkpoint_version         3.0 (legacy QKV orders before 2.0 are refused)
    iteration                  the iteration saved
    opt_param_scheduler        OptimizerParamScheduler.state_dict(): max_lr, min_lr,
                               lr_warmup_steps, lr_decay_steps, lr_decay_style, num_steps (all in
                               samples), start_wd, end_wd, wd_incr_style, wd_incr_steps
    optimizer                  the optimizer's non-tensor state: param_groups (lr, betas, eps,
                               weight_decay, "step" with the distributed optimizer), "common_step"
                               (the plain one), param_state_sharding_type (distributed),
                               grad_scaler (fp16: DynamicGradScaler's scale and trackers)
    rng_state                  per (pipeline, tensor) rank (a sharded object in torch_dist)
    num_floating_point_operations_so_far, rerun_state_machine, content_metadata

`check_model` refuses, in one line naming both values and the flags that match, an architecture
argument that differs from this run's; `check_schedule` the same for the lr schedule.
"""
from __future__ import annotations

import math

from megatron_2bw.checkpoint.files import CheckpointError


def args_of(state: dict) -> dict:
    """Megatron's arguments as a dict ({} when the checkpoint records none)."""
    args = state.get("args")
    return dict(vars(args)) if args is not None and hasattr(args, "__dict__") else \
        dict(args or {})


def _get(args: dict, *names, default=None):
    for n in names:
        if args.get(n) is not None:
            return args[n]
    return default


def model_settings(args: dict, family: str) -> tuple[dict, list[str]]:
    """(our ModelConfig fields the arguments fix, what they use that this project lacks: one
    phrase each). Empty when the checkpoint records no arguments."""
    if not args:
        return {}, []
    heads = args.get("num_attention_heads")
    gqa = bool(args.get("group_query_attention"))
    swiglu = bool(args.get("swiglu"))
    bias = bool(_get(args, "add_bias_linear", default=True))
    pos = _get(args, "position_embedding_type", default="learned_absolute")
    if args.get("add_position_embedding") is False and pos == "learned_absolute":
        pos = "none"
    # Megatron's default --bias-gelu-fusion computes GeLU by its tanh approximation
    fused = bool(_get(args, "bias_gelu_fusion", default=False)) and bias and not swiglu
    out = {"num_layers": args.get("num_layers"), "hidden_size": args.get("hidden_size"),
           "ffn_hidden_size": args.get("ffn_hidden_size"), "num_attention_heads": heads,
           "max_position_embeddings": args.get("max_position_embeddings"),
           "vocab_size": _get(args, "padded_vocab_size"), "position_embedding_type": pos,
           "rotary_base": float(_get(args, "rotary_base", default=10000)),
           "rotary_percent": float(_get(args, "rotary_percent", default=1.0)),
           "normalization": _get(args, "normalization", default="LayerNorm"),
           "layernorm_epsilon": float(_get(args, "norm_epsilon", "layernorm_epsilon",
                                           default=1e-5)),
           "swiglu": swiglu, "group_query_attention": gqa,
           "num_query_groups": args.get("num_query_groups") if gqa else heads,
           "num_kv_channels": args.get("kv_channels"), "add_bias_linear": bias,
           "openai_gelu": bool(args.get("openai_gelu")) or fused,
           "untie_embeddings_and_output_weights": bool(
               args.get("untie_embeddings_and_output_weights")),
           "apply_layernorm_1p": bool(args.get("apply_layernorm_1p")),
           "qk_layernorm": bool(args.get("qk_layernorm"))}
    if family == "bert":
        out["bert_binary_head"] = bool(_get(args, "bert_binary_head", default=True))
    out = {k: v for k, v in out.items() if v is not None}
    lacks = [what for on, what in (
        (args.get("num_experts"), f"--num-experts {args.get('num_experts')} (mixture of experts)"),
        (args.get("multi_latent_attention"), "--multi-latent-attention"),
        (args.get("rotary_interleaved"), "--rotary-interleaved"),
        (args.get("squared_relu"), "--squared-relu"),
        (args.get("fp32_residual_connection"), "--fp32-residual-connection"),
        (pos not in ("learned_absolute", "rope"), f"--position-embedding-type {pos}"),
        (bool(args.get("add_qkv_bias")) and not bias, "--add-qkv-bias without linear biases"),
        (_get(args, "virtual_pipeline_model_parallel_size", default=1) > 1,
         "a virtual pipeline (--num-layers-per-virtual-pipeline-stage)"))
        if on]
    return out, lacks


_FLAGS = {"num_layers": "--num-layers", "hidden_size": "--hidden-size",
          "ffn_hidden_size": "--ffn-hidden-size", "num_attention_heads": "--num-attention-heads",
          "max_position_embeddings": "--max-position-embeddings",
          "vocab_size": "--vocab-size (the padded vocabulary)",
          "position_embedding_type": "--position-embedding-type", "rotary_base": "--rotary-base",
          "rotary_percent": "--rotary-percent", "normalization": "--normalization",
          "layernorm_epsilon": "--norm-epsilon", "swiglu": "--swiglu",
          "num_query_groups": "--group-query-attention --num-query-groups",
          "num_kv_channels": "--kv-channels", "add_bias_linear": "--disable-bias-linear",
          "openai_gelu": "--openai-gelu", "untie_embeddings_and_output_weights":
          "--untie-embeddings-and-output-weights", "apply_layernorm_1p": "--apply-layernorm-1p",
          "qk_layernorm": "--qk-layernorm", "bert_binary_head": "--bert-no-binary-head"}
_INVERTED = {"add_bias_linear", "bert_binary_head"}  # the flag turns the setting off


def _ours(m, key):
    return {"ffn_hidden_size": m.ffn_size, "num_query_groups": m.query_groups,
            "num_kv_channels": m.kv_channels,
            "max_position_embeddings": m.max_positions}.get(key, getattr(m, key, None))


def setting_flag(key, value) -> str | None:
    """The flag (and value) that gives ModelConfig field `key` the setting `value` ("--rotary-base
    10000", "no --apply-layernorm-1p"); None for a field no flag sets."""
    if key not in _FLAGS:
        return None
    flag = _FLAGS[key]
    if isinstance(value, bool):
        on = value != (key in _INVERTED)
        return flag if on else f"no {flag}"
    return f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}"


def model_problems(args: dict, m) -> list[str]:
    """What in Megatron's arguments differs from the model `m` (our ModelConfig)."""
    theirs, lacks = model_settings(args, m.family)
    if theirs.get("num_kv_channels") is None and "hidden_size" in theirs:
        theirs["num_kv_channels"] = theirs["hidden_size"] // theirs["num_attention_heads"]
    if "ffn_hidden_size" not in theirs and "hidden_size" in theirs and not theirs.get("swiglu"):
        theirs["ffn_hidden_size"] = 4 * theirs["hidden_size"]
    skip = set()
    if theirs.get("position_embedding_type") != "learned_absolute":
        skip.add("max_position_embeddings")
    if theirs.get("position_embedding_type") != "rope":
        skip |= {"rotary_base", "rotary_percent"}
    if m.family == "bert":
        skip.add("untie_embeddings_and_output_weights")
    out = []
    for key, value in theirs.items():
        if key in skip or key not in _FLAGS:
            continue
        ours = _ours(m, key)
        same = math.isclose(value, ours, rel_tol=1e-9) if isinstance(value, float) \
            else value == ours
        if not same:
            out.append(f"{key} {value} (this run: {ours}; use {setting_flag(key, value)})")
    if m.family == "bert" and (theirs.get("normalization", "LayerNorm") != "LayerNorm" or
                               theirs.get("apply_layernorm_1p")):
        out.append(BERT_HEAD_NORM)
    return [f"it uses {x}, which this project does not build" for x in lacks] + out


# Megatron's BERT LM head norms by --normalization and --apply-layernorm-1p, ours is plain
BERT_HEAD_NORM = ("a BERT LM head whose norm follows --normalization RMSNorm or "
                  "--apply-layernorm-1p (Megatron's); this project's BERT LM head keeps a plain "
                  "LayerNorm there")


def check_model(args: dict, m, where: str) -> None:
    problems = model_problems(args, m)
    if problems:
        raise CheckpointError(f"checkpoint {where} was saved by Megatron for another model: "
                              f"{'; '.join(problems)}")


def parallel_of(args: dict) -> dict:
    """The layout that saved it, in resume.py's words (Megatron's 1F1B is our flush)."""
    return {"tensor": args.get("tensor_model_parallel_size"),
            "pipeline": args.get("pipeline_model_parallel_size"),
            "data": args.get("data_parallel_size"), "world": args.get("world_size"),
            "schedule": "flush" if args else None}


def consumed_samples(state: dict, iteration: int) -> int:
    """Megatron's data position: args.consumed_train_samples (its loader's rule: 0 without)."""
    return int(_get(args_of(state), "consumed_train_samples", default=0))


def schedule_problems(state: dict, cfg, global_batch: int) -> list[str]:
    """What in the checkpoint's lr scheduler differs from this run's schedule (Megatron counts
    its steps in samples: warmup and decay spans are iterations x the global batch)."""
    saved = state.get("opt_param_scheduler")
    if not saved:
        return []
    from megatron_2bw.optim.lr import LRSchedule
    o = cfg.optimizer
    ours = LRSchedule(o, cfg.train.train_iters, global_batch)
    want = {"max_lr": (o.lr, "--lr"), "min_lr": (o.min_lr, "--min-lr"),
            "lr_warmup_steps": (ours.warmup_iters * global_batch, "--lr-warmup-iters"),
            "lr_decay_steps": (ours.decay_iters * global_batch, "--lr-decay-iters"),
            "lr_decay_style": (o.lr_decay_style, "--lr-decay-style"),
            "start_wd": (o.weight_decay, "--weight-decay"),
            "end_wd": (o.weight_decay, "--weight-decay")}
    out = []
    for key, (value, flag) in want.items():
        have = saved.get(key)
        if have is None:
            continue
        same = have == value if isinstance(have, str) else math.isclose(
            float(have), float(value), rel_tol=1e-9, abs_tol=1e-12)
        if not same:
            shown = f"{have:g}" if isinstance(have, float) else str(have)
            fix = f"{have / global_batch:g}" if key.endswith("_steps") else shown
            out.append(f"{key} {shown} (this run: {value:g}; use {flag} {fix})"
                       if not isinstance(have, str) else
                       f"{key} {shown} (this run: {value}; use {flag} {fix})")
    return out


def optimizer_problems(state: dict, cfg) -> list[str]:
    """What in the checkpoint's optimizer settings differs from this run's, where its state
    would carry over (Megatron steps on with the param groups it saved: betas, eps)."""
    args, o = args_of(state), cfg.optimizer
    name = args.get("optimizer")
    out = []
    if name is not None and name != o.name:
        out.append(f"optimizer {name} (this run: {o.name}; use --optimizer {name}, or "
                   "--no-load-optim to start its state fresh)")
        return out
    groups = optimizer_record(state).get("param_groups") or [{}]
    betas = groups[0].get("betas")
    saved = {"adam_beta1": betas[0] if betas else args.get("adam_beta1"),
             "adam_beta2": betas[1] if betas else args.get("adam_beta2"),
             "adam_eps": groups[0].get("eps", args.get("adam_eps"))} if o.name == "adam" else \
        {"sgd_momentum": groups[0].get("momentum", args.get("sgd_momentum"))}
    for key, have in saved.items():
        ours = getattr(o, key)
        if have is not None and not math.isclose(float(have), ours, rel_tol=1e-9):
            out.append(f"{key} {float(have):g} (this run: {ours:g}; use "
                       f"--{key.replace('_', '-')} {float(have):g}, or --no-load-optim)")
    return out


def optimizer_record(state: dict) -> dict:
    """The optimizer's non-tensor state in common.pt, whatever wrapper Megatron used."""
    opt = state.get("optimizer") or {}
    while isinstance(opt, dict) and "param_groups" not in opt and isinstance(
            opt.get("optimizer"), dict):
        opt = dict(opt["optimizer"], **{k: v for k, v in opt.items() if k != "optimizer"})
    return opt if isinstance(opt, dict) else {}


def optimizer_steps(state: dict) -> int | None:
    opt = optimizer_record(state)
    step = (opt.get("state") or {}).get("common_step")
    if step is None:
        steps = [g.get("step") for g in opt.get("param_groups") or () if g.get("step") is not None]
        step = steps[0] if steps else None
    return None if step is None else int(step)


def loss_scaler_state(state: dict) -> dict | None:
    """An fp16 run's dynamic loss scale (megatron-core's DynamicGradScaler.state_dict: scale,
    growth_tracker, hysteresis_tracker) as our DynamicLossScaler's state: the same rule
    (optim/loss_scale.py), its growth tracker our clean steps, its hysteresis tracker ours.
    None where the checkpoint holds none (bf16, fp32, a constant --loss-scale)."""
    import torch
    g = optimizer_record(state).get("grad_scaler")
    if not isinstance(g, dict) or not {"scale", "growth_tracker", "hysteresis_tracker"} <= set(g):
        return None
    scale = g["scale"]
    scale = float(scale.reshape(-1)[0]) if torch.is_tensor(scale) else float(scale)
    return {"scale": scale, "clean": int(g["growth_tracker"]),
            "tracker": int(g["hysteresis_tracker"])}
