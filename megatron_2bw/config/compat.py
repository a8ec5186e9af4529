"""Megatron-LM flags this engine takes for compatibility: what each does here (DESIGN.md section 5).

Every flag of Megatron-LM's GPT, Llama and BERT example scripts parses. Three kinds live here
(the flags with a meaning of their own are registered by flags.py, data/flags.py and pretrain.py;
a name registered there is never registered here):

- NOTED: implementation selectors and performance switches that do not change the arithmetic.
  They are accepted and stated in one log line each (`notes`): what the engine does instead.
- NEUTRAL: a feature the engine does not have, accepted at its neutral value (Megatron's default:
  --context-parallel-size 1, --num-experts unset, ...) and refused at any other value.
- REFUSED: features whose flags have no neutral value to give (fp8, MoE settings, ...): given at
  all, they are refused.

`refusals(args, unknown)` lists every refusal of one command, each with its reason: unknown flags
(with the closest valid name where one is plausible, suggest.py; the retired ones with their
replacement, `RETIRED`) and the features above; the parser prints them in one message and exits
2. Megatron-DeepSpeed's selectors and features are in compat_mds.py, merged into these tables.
"""
from __future__ import annotations

import argparse

from megatron_2bw.config import compat_mds
from megatron_2bw.config.suggest import closest_flag

# flag -> (argparse keywords, the line logged when it is given)
NOTED = {
    "--attention-backend": (
        dict(choices=("auto", "flash", "fused", "unfused", "local"), default=None),
        "attention runs torch's scaled_dot_product_attention, which picks the flash, "
        "memory-efficient or math kernel for the device (the same softmax(QK^T/sqrt(d))V)"),
    "--use-flash-attn": (dict(action="store_true", default=None),
                         "attention runs torch's scaled_dot_product_attention (flash on CUDA "
                         "where it applies)"),
    "--transformer-impl": (dict(choices=("local", "transformer_engine", "inference_optimized"),
                                default=None),
                           "one transformer implementation (torch modules, models/); "
                           "Transformer Engine is not used"),
    "--use-mcore-models": (dict(action="store_true", default=None),
                           "one model implementation (models/): Megatron-core's layout and names"),
    "--use-legacy-models": (dict(action="store_true", default=None),
                            "one model implementation (models/): Megatron-core's layout and names"),
    "--cross-entropy-loss-fusion": (dict(action="store_true", default=None),
                                    "the vocab-parallel cross entropy is one implementation "
                                    "(tensor_parallel/cross_entropy.py), the same arithmetic"),
    "--no-create-attention-mask-in-dataloader": (
        dict(action="store_true", default=None),
        "the loader never builds attention masks: causal attention masks inside the kernel"),
    "--no-mmap-bin-files": (dict(action="store_true", default=None),
                            "the .bin files are memory-mapped; the tokens read are the same"),
    "--manual-gc": (dict(action="store_true", default=None),
                    "Python's garbage collector runs as usual (no effect on the arithmetic)"),
    "--manual-gc-interval": (dict(type=int, default=None),
                             "Python's garbage collector runs as usual"),
    "--empty-unused-memory-level": (dict(type=int, default=None),
                                    "the allocator's cache is not emptied between iterations"),
    "--grad-reduce-in-bf16": (dict(action="store_true", default=None),
                              "gradients are reduced in fp32 (the master gradients' type): "
                              "more exact than bf16, twice the bytes"),
    "--overlap-param-gather": (dict(action="store_true", default=None),
                               "with --use-distributed-optimizer the engine all-gathers the new "
                               "weights asynchronously and waits only where the next forward "
                               "reads them (always on)"),
    "--tp-comm-overlap": (dict(action="store_true", default=None),
                          "tensor-parallel all-gathers and reduce-scatters are not overlapped "
                          "with the GEMMs (no userbuffers); the results are the same"),
    "--calculate-per-token-loss": (
        dict(action="store_true", default=None),
        "every microbatch has the same number of loss tokens here (no loss mask), so the mean "
        "over the batch's tokens equals the mean of the microbatch means the engine takes"),
    "--exit-signal-handler": (
        dict(action="store_true", default=None),
        "SIGTERM, SIGUSR1 and SIGINT always save a checkpoint (with --save) and exit at the "
        "next iteration boundary (training/reliability.py)"),
    "--timing-log-level": (dict(type=int, choices=(0, 1, 2), default=None),
                           "per-action timers are --wall-clock-breakdown (log line) and "
                           "--log-timers-to-tensorboard"),
    "--no-async-tensor-model-parallel-allreduce": (
        dict(action="store_true", default=None),
        "the tensor-parallel all-reduce of the input gradient runs where the backward needs it"),
    "--attention-softmax-in-fp32": (
        dict(action="store_true", default=None),
        "the softmax runs inside torch's scaled_dot_product_attention, at its precision"),
    "--accumulate-allreduce-grads-in-fp32": (
        dict(action="store_true", default=None),
        "gradients are always accumulated and reduced in fp32"),
    "--ddp-average-in-collective": (dict(action="store_true", default=None),
                                    "the data-parallel reduction averages (the same numbers)"),
    "--auto-detect-ckpt-format": (dict(action="store_true", default=None),
                                  "loading always reads either checkpoint format"),
    "--ckpt-fully-parallel-save": (dict(action="store_true", default=None),
                                   "every rank writes its own part of a torch_dist checkpoint"),
    "--ckpt-fully-parallel-load": (dict(action="store_true", default=None),
                                   "every rank reads its own part of a torch_dist checkpoint"),
    "--ckpt-assume-constant-structure": (dict(action="store_true", default=None),
                                         "each save plans its layout (the files are the same)"),
    "--log-validation-ppl-to-tensorboard": (
        dict(action="store_true", default=None),
        "`lm loss validation ppl` is always written to TensorBoard"),
    "--log-memory-to-tensorboard": (dict(action="store_true", default=None),
                                    "the memory per stage is always written to TensorBoard"),
    "--distribute-saved-activations": (
        dict(action="store_true", default=None),
        "each tensor rank keeps the whole input of a recomputed layer (Megatron splits it over "
        "the tensor group): more memory, the same arithmetic"),
    "--use-checkpoint-opt_param-scheduler": (
        dict(action="store_true", default=None),
        "the lr schedule is a function of the iteration: a resumed run continues it"),
}

NOTED.update({
    "--use-cpu-initialization": (
        dict(action="store_true", default=None),
        "parameters are always initialized on the CPU from per-layer seeds, then moved to the "
        "device (the same values on any device)"),
    "--no-initialization": (dict(action="store_true", default=None),
                            "parameters are always initialized (a loaded checkpoint then "
                            "overwrites them)"),
    "--no-save-rng": (dict(action="store_true", default=None),
                      "the RNG state is always saved (a few KB; --no-load-rng leaves it unread)"),
    "--override-opt_param-scheduler": (
        dict(action="store_true", default=None),
        "the lr schedule always comes from the command line, at the resumed iteration"),
    "--apply-query-key-layer-scaling": (
        dict(action="store_true", default=None),
        "not applied: the 1/layer-number scaling of the scores cancels in the softmax (Megatron "
        "uses it against fp16 overflow in its fused softmax; here torch's "
        "scaled_dot_product_attention)"),
    "--log-progress": (dict(action="store_true", default=None),
                       "progress (iteration, consumed samples, ETA) is in every log line; no "
                       "progress.txt is written"),
    "--log-batch-size-to-tensorboard": (
        dict(action="store_true", default=None),
        "the global batch is in the run's first log line (global-batch=)"),
    "--log-world-size-to-tensorboard": (
        dict(action="store_true", default=None),
        "the world size is in the run's first log line (t x d x w)"),
    "--no-log-loss-scale-to-tensorboard": (dict(action="store_true", default=None),
                                           "TensorBoard still gets the loss scale"),
    "--no-log-learnig-rate-to-tensorboard": (dict(action="store_true", default=None),
                                             "TensorBoard still gets the learning rate"),
    "--timing-log-option": (dict(choices=("max", "minmax", "all"), default=None),
                            "per-action timers are --wall-clock-breakdown (log line) and "
                            "--log-timers-to-tensorboard"),
    "--no-barrier-with-level-1-timing": (dict(action="store_true", default=None),
                                         "timers never add barriers here"),
    "--num-dataset-builder-threads": (dict(type=int, default=None),
                                      "one process per node builds the dataset index (the "
                                      "same index)"),
    "--no-scatter-gather-tensors-in-pipeline": (
        dict(action="store_true", default=None),
        "stage-to-stage messages go whole (with --sequence-parallel, each rank's chunk)"),
    "--no-overlap-p2p-communication": (dict(action="store_true", default=None),
                                       "point-to-point transfers are batched and non-blocking"),
    "--use-ring-exchange-p2p": (dict(action="store_true", default=None),
                                "point-to-point transfers are torch.distributed's batched "
                                "isend/irecv"),
    "--delay-param-gather": (dict(action="store_true", default=None),
                             "the distributed optimizer's all-gather runs as the engine "
                             "schedules it"),
    "--no-delay-grad-reduce": (dict(action="store_true", default=None),
                               "the data-parallel buckets start as the engine schedules them"),
    "--nccl-communicator-config-path": (dict(default=None),
                                        "NCCL communicators keep NCCL's defaults (the file is "
                                        "not read)"),
    "--no-clone-scatter-output-in-embedding": (
        dict(action="store_true", default=None),
        "a memory switch of Megatron's sequence-parallel embedding (the same values)"),
    "--no-manual-gc-eval": (dict(action="store_true", default=None),
                            "Python's garbage collector runs as usual"),
    "--no-fp8-wgrad": (dict(action="store_true", default=None), "no fp8 here"),
})
for _flag in ("--tp-comm-overlap-rs-dgrad", "--disable-tp-comm-bulk-dgrad",
              "--disable-tp-comm-bulk-wgrad", "--disable-tp-comm-overlap-ag",
              "--disable-tp-comm-overlap-rs", "--disable-tp-comm-split-ag",
              "--disable-tp-comm-split-rs", ("--tp-comm-overlap-cfg", dict(default=None))):
    _flag, _kw = _flag if isinstance(_flag, tuple) else (_flag, dict(action="store_true",
                                                                      default=None))
    NOTED[_flag] = (_kw, NOTED["--tp-comm-overlap"][1])

for _flag in ("--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
              "--no-bias-swiglu-fusion", "--no-gradient-accumulation-fusion", "--no-rope-fusion",
              "--disable-te-fused-rope", "--use-contiguous-parameters-in-local-ddp",
              "--no-persist-layer-norm", "--defer-embedding-wgrad-compute"):
    NOTED[_flag] = (dict(action="store_true", default=None),
                    "a kernel-fusion switch: the engine's kernels compute the same either way")

# Megatron-LM's retired flags that Megatron-DeepSpeed retired too (its arguments.py refuses them
# with the replacement): flag -> the fix, in Megatron's meaning (a closest-name guess would
# mislead: --warmup took a fraction). The ones Megatron-DeepSpeed still uses (--checkpoint-
# activations, --data-impl, ...) are taken with its meaning (mds_flags.py, compat_mds.py).
RETIRED = {
    "--batch-size": "use --micro-batch-size",
    "--warmup": "use --lr-warmup-fraction (the same fraction)",
    "--model-parallel-size": "use --tensor-model-parallel-size",
}

# flag -> (argparse keywords, neutral value, the feature it selects)
NEUTRAL = {
    "--context-parallel-size": (dict(type=int, default=1), 1, "context parallelism"),
    "--expert-model-parallel-size": (dict(type=int, default=1), 1, "expert parallelism (MoE)"),
    "--expert-tensor-parallel-size": (dict(type=int, default=None), (None, 1),
                                      "expert tensor parallelism (MoE)"),
    # Megatron-DeepSpeed's form (a list; its default [1] is the dense model) takes Megatron-LM's N
    "--num-experts": (dict(type=int, nargs="+", default=None), (None, [1]), "mixture of experts"),
    "--num-layers-per-virtual-pipeline-stage": (dict(type=int, default=None), None,
                                                "the interleaved (virtual pipeline) schedule"),
    "--virtual-pipeline-model-parallel-size": (dict(type=int, default=None), None,
                                               "the interleaved (virtual pipeline) schedule"),
    "--fp8-format": (dict(choices=("e4m3", "hybrid"), default=None), None, "fp8 training"),
    "--fp8-recipe": (dict(default=None), None, "fp8 training"),
    "--fp8-margin": (dict(type=int, default=0), 0, "fp8 training"),
    "--fp8-interval": (dict(type=int, default=1), 1, "fp8 training"),
    "--fp8-amax-history-len": (dict(type=int, default=1), 1, "fp8 training"),
    "--fp8-amax-compute-algo": (dict(choices=("most_recent", "max"), default="most_recent"),
                                "most_recent", "fp8 training"),
    "--fp8-param-gather": (dict(action="store_true", default=False), False, "fp8 training"),
    "--moe-router-topk": (dict(type=int, default=2), 2, "mixture of experts"),
    "--moe-grouped-gemm": (dict(action="store_true", default=False), False, "mixture of experts"),
    "--log-num-zeros-in-grad": (dict(action="store_true", default=False), False,
                                "logging the gradient's zeros"),
    "--dataloader-type": (dict(choices=("single", "cyclic", "external"), default=None),
                          (None, "single"), "the cyclic and external data loaders"),
    "--num-distributed-optimizer-instances": (dict(type=int, default=1), 1,
                                              "several distributed-optimizer instances"),
    "--use-rope-scaling": (dict(action="store_true", default=False), False,
                           "Llama 3.1's RoPE frequency scaling"),
    "--rotary-seq-len-interpolation-factor": (dict(type=int, default=None), None,
                                              "RoPE sequence-length interpolation"),
    "--fp16-lm-cross-entropy": (dict(action="store_true", default=False), False,
                                "the cross entropy in fp16"),
    "--no-position-embedding": (dict(action="store_true", default=False), False,
                                "a GPT without any position information"),
    "--fp32-residual-connection": (dict(action="store_true", default=False), False,
                                   "fp32 residual connections"),
    "--apply-residual-connection-post-layernorm": (dict(action="store_true", default=False),
                                                   False, "the residual taken after the norm"),
    "--add-qkv-bias": (dict(action="store_true", default=False), False,
                       "a bias on the QKV projection alone"),
    "--rotary-interleaved": (dict(action="store_true", default=False), False,
                             "interleaved RoPE"),
    "--squared-relu": (dict(action="store_true", default=False), False, "the squared-ReLU MLP"),
    "--start-weight-decay": (dict(type=float, default=None), None, "a weight-decay schedule"),
    "--end-weight-decay": (dict(type=float, default=None), None, "a weight-decay schedule"),
    "--weight-decay-incr-style": (dict(choices=("constant", "linear", "cosine"),
                                       default="constant"), "constant",
                                  "a weight-decay schedule"),
    "--data-parallel-random-init": (dict(action="store_true", default=False), False,
                                    "different initial weights per data-parallel replica"),
    "--init-method-xavier-uniform": (dict(action="store_true", default=False), False,
                                     "Xavier-uniform initialization"),
    "--standalone-embedding-stage": (dict(action="store_true", default=False), False,
                                     "Megatron's embedding-only first stage flag"),
    "--adlr-autoresume": (dict(action="store_true", default=False), False, "ADLR autoresume"),
}
# features accepted where another flag makes them neutral: flag -> (is it neutral here, line)
NEUTRAL_WHEN = {
    "--no-position-embedding": (
        lambda args: getattr(args, "position_embedding_type", None) == "rope",
        "with --position-embedding-type rope there is no learned position table"),
    "--reset-position-ids": (  # megatron-core: RotaryEmbedding(seq_len), position_ids unused
        lambda args: getattr(args, "position_embedding_type", None) == "rope",
        "no effect on RoPE positions, as in Megatron-core (the rotary angles come from the "
        "sequence length; position ids reach only a learned position table)"),
}
# what to do instead, by feature (the refusal's second half)
INSTEAD = {
    "fp8 training": "train in --bf16 (drop the fp8 flags)",
    "mixture of experts": "train a dense model (drop the MoE flags)",
    "expert parallelism (MoE)": "drop it (no experts to place)",
    "expert tensor parallelism (MoE)": "drop it (no experts to place)",
    "context parallelism": "use --context-parallel-size 1 (shorter sequences per rank need "
                           "tensor or pipeline parallelism here)",
    "the interleaved (virtual pipeline) schedule": "use --pipeline-schedule 2bw, flush or gpipe",
    "fp32 residual connections": "drop it (residuals run in the model's dtype)",
    "a weight-decay schedule": "use --weight-decay (constant)",
    "Xavier-uniform initialization": "use --init-method-std",
    "Megatron's embedding-only first stage flag": "give --pipeline-partition 0,1,... (stage 0 "
                                                  "the embedding alone)",
    "ADLR autoresume": "drop it (SIGTERM and SIGUSR1 save and exit; see the README's "
                       "Preemption section)",
    "the residual taken after the norm": "drop it (the residual is taken before the norm)",
    "a bias on the QKV projection alone": "drop it (every linear layer keeps its bias; "
                                          "--disable-bias-linear removes them all)",
    "the squared-ReLU MLP": "use the GeLU MLP (the default) or --swiglu",
    "interleaved RoPE": "drop it (RoPE rotates the two halves of each head, Megatron's default)",
    "different initial weights per data-parallel replica": "drop it (every replica starts from "
                                                           "the same weights)",
}

# Megatron-DeepSpeed's selectors and features (its own module: compat_mds.py)
NOTED.update(compat_mds.NOTED)
NEUTRAL.update(compat_mds.NEUTRAL)
NEUTRAL_WHEN.update(compat_mds.NEUTRAL_WHEN)
INSTEAD.update(compat_mds.INSTEAD)


def _flag_dest(flag: str) -> str:
    return flag[2:].replace("-", "_")


def add_compat_args(p: argparse.ArgumentParser) -> None:
    """Register the flags above that no other group of the parser registered."""
    taken = set(p._option_string_actions)
    g = p.add_argument_group("Megatron compatibility (see config/compat.py; what each does here)")
    for flag, (kw, line) in NOTED.items():
        if flag not in taken:
            g.add_argument(flag, help=f"accepted: {line}", **kw)
    for flag, (kw, neutral, feature) in NEUTRAL.items():
        if flag not in taken:
            shown = neutral if not isinstance(neutral, tuple) else neutral[-1]
            g.add_argument(flag, help=f"{feature} is not in this engine: only the neutral value "
                                      f"({shown}) is accepted", **kw)


def notes(args: argparse.Namespace) -> list[str]:
    """One line per NOTED flag given (what the engine does instead)."""
    out = []
    for flag, (_kw, line) in NOTED.items():
        value = getattr(args, _flag_dest(flag), None)
        if value is not None and value is not False:
            shown = flag if value is True else f"{flag} {value}"
            out.append(f"megatron-2bw: {shown}: {line}")
    for flag, (neutral_here, line) in NEUTRAL_WHEN.items():
        value = getattr(args, _flag_dest(flag), None)
        neutral = NEUTRAL[flag][1] if flag in NEUTRAL else False
        if value not in (None, False) + (neutral if isinstance(neutral, tuple) else (neutral,)) \
                and neutral_here(args):  # given off its neutral value, where it changes nothing
            out.append(f"megatron-2bw: {_shown(flag, value)}: {line}")
    return out


def refusals(parser: argparse.ArgumentParser, args: argparse.Namespace,
             unknown: list[str]) -> list[str]:
    """Every refusal of one command line, one line each: unknown flags (with a did-you-mean),
    then each feature whose flags were given off their neutral value (its flags on one line)."""
    valid = [o for a in parser._actions for o in a.option_strings]
    out, after_unknown = [], False
    for token in unknown:
        if not token.startswith("-") or token.lstrip("-") == "" or _is_number(token):
            if not after_unknown:  # a value no flag took: a switch given one (--fp16 true)
                out.append(f"unexpected value {token!r}: no flag takes it (a switch takes no "
                           "value); drop it")
                after_unknown = True  # its further values are its
            continue  # a value of an unknown flag
        after_unknown = True
        flag = token.split("=")[0]
        if flag in RETIRED:
            out.append(f"{flag} is a retired Megatron-LM flag: {RETIRED[flag]}")
            continue
        close = closest_flag(flag, valid)
        hint = f" (did you mean {close}?)" if close else ""
        out.append(f"unknown flag {flag}{hint}")
    by_feature: dict[str, list[str]] = {}
    for flag, (_kw, neutral, feature) in NEUTRAL.items():
        if parser._option_string_actions.get(flag) is None:
            continue
        dest = parser._option_string_actions[flag].dest
        value = getattr(args, dest, None)
        allowed = neutral if isinstance(neutral, tuple) else (neutral,)
        when = NEUTRAL_WHEN.get(flag)
        if value not in allowed and not (when and when[0](args)):
            by_feature.setdefault(feature, []).append(_shown(flag, value))
    for feature, flags in by_feature.items():
        instead = INSTEAD.get(feature, f"drop {'them' if len(flags) > 1 else 'it'}")
        out.append(f"{', '.join(flags)}: {feature} is not in this engine; {instead}")
    if getattr(args, "calculate_per_token_loss", None) and getattr(args, "eod_mask_loss", False):
        out.append("--calculate-per-token-loss with --eod-mask-loss: the mean over the global "
                   "batch's unmasked tokens is not in this engine (it takes the mean of the "
                   "microbatch means); drop --calculate-per-token-loss")
    return out


def _shown(flag: str, value) -> str:
    """A flag as typed: `--flag`, `--flag VALUE` or `--flag V1 V2` (a list)."""
    if value is True:
        return flag
    return f"{flag} {' '.join(map(str, value)) if isinstance(value, list) else value}"


def _is_number(token: str) -> bool:
    try:
        float(token)
        return True
    except ValueError:
        return False
