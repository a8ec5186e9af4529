"""Megatron-LM command line -> Config. Same flag names and meanings as Megatron where they exist."""
from __future__ import annotations

import argparse
import sys

from megatron_2bw.config.architecture_flags import (  # noqa: F401  (planner/cli.py's names)
    ARCHITECTURE_FLAGS, add_architecture_args, apply_architecture_args)
from megatron_2bw.config import (CKPT_FORMATS, LR_DECAY_STYLES, OPTIMIZERS, RANK_ORDERS,
                                 RECOMPUTE_GRANULARITIES, BatchConfig, Config,
                                 ConfigError, ModelConfig, OptimizerConfig, ParallelConfig,
                                 TrainConfig)
from megatron_2bw.config.checks import OPTIMIZER_IMPLS
from megatron_2bw.config.compat import refusals
from megatron_2bw.config.flavours import FLAVOURS, flavour_shape
from megatron_2bw.config.log_flags import add_observability_args, logger_fields
from megatron_2bw.config.mds_flags import fold_mds_args, mds_model
from megatron_2bw.config.numbers import FiniteParser
from megatron_2bw.config.precision_flags import add_precision_args, precision_from_args
from megatron_2bw.config.ramps import add_ramp_args, batch_ramp_problems, ramp_fields
from megatron_2bw.config.reduce_flags import add_reduce_args, reduce_config
from megatron_2bw.config.schedule_flags import add_schedule_args, schedule_fields


class FlagParser(FiniteParser):
    """argparse whose errors are one message: every refused flag of the command line on a line of
    its own, each with its reason (unknown flags with the closest valid one; features the engine
    does not have: config/compat.py), then exit 2. Float flags are finite (config/numbers.py)."""

    def parse_args(self, args=None, namespace=None):
        args, unknown = self.parse_known_args(args, namespace)
        problems = fold_mds_args(args)  # Megatron-DeepSpeed's flags in Megatron-LM's terms
        problems += refusals(self, args, unknown) + batch_ramp_problems(args)
        if problems:
            self.exit(2, "".join(f"{self.prog}: error: {line}\n" for line in problems))
        return args


# --mock-data without a tokenizer: Megatron has no default (its tokenizer sets the vocabulary)
MOCK_VOCAB_SIZE = 512
# shape defaults when neither --model nor the flag gives one (the `debug` flavour)
SHAPE_DEFAULTS = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 32}


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None, metavar="NAME",
                   help=f"named model shape ({', '.join(FLAVOURS)}); explicit flags override it")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--seq-length", type=int, default=None)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--vocab-size", type=int, default=None,
                   help="as in Megatron, the tokenizer sets the vocabulary; this is for "
                        f"--mock-data without a tokenizer (default {MOCK_VOCAB_SIZE}) and the "
                        "NullTokenizer")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true",
                   help="GPT: leave out of the loss the positions whose input token is the "
                        "tokenizer's end of document (Megatron's loss mask)")
    g.add_argument("--reset-position-ids", action="store_true",
                   help="GPT with learned positions: position ids restart at 0 after each end "
                        "of document")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="GPT: a token attends only to the tokens of its own document (from the "
                        "token after the last end of document before it; an end of document "
                        "belongs to the document it ends), as Megatron's "
                        "get_ltor_masks_and_position_ids")
    g.add_argument("--recompute-activations", action="store_true",
                   help="selective recomputation, as in Megatron: recompute core attention "
                        "(softmax and dropout over the scores) in backward, keep the rest. "
                        "CHANGED: it used to mean full recomputation of every layer; for that "
                        "give --recompute-granularity full --recompute-method uniform "
                        "--recompute-num-layers 1")
    g.add_argument("--recompute-granularity", choices=RECOMPUTE_GRANULARITIES, default=None,
                   help="selective: core attention (= --recompute-activations); full: whole "
                        "transformer layers, chosen by --recompute-method and "
                        "--recompute-num-layers")
    g.add_argument("--recompute-method", choices=("uniform", "block"), default=None,
                   help="full recomputation: uniform (chunks of N layers) or block (the first N "
                        "layers of each stage)")
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="full recomputation: the layers of a chunk (uniform) or of each stage "
                        "(block); default 1, as in Megatron")
    add_architecture_args(p)


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--data-parallel-size", type=int, default=None,
                   help="default: world size / (tensor x pipeline), as Megatron derives it")
    add_schedule_args(g)
    g.add_argument("--rank-order", choices=RANK_ORDERS, default=None,
                   help="innermost axis first (default tp-dp-pp, Megatron's)")
    g.add_argument("--use-tp-pp-dp-mapping", action="store_true",
                   help="Megatron's name for --rank-order tp-pp-dp")
    g.add_argument("--pipeline-partition", type=partition_arg, default=None, metavar="B0,..,Bd",
                   help="stage boundaries over [embedding, transformer layers..., head] (spec "
                        "indices: 0, ..., num_layers + 2; stage s runs [B_s, B_s+1)), as "
                        "tools/plan.py prints them; default: the layers split evenly, the "
                        "embedding on the first stage, the head on the last")
    g.add_argument("--distributed-backend", choices=("gloo", "nccl"), default=None)
    g.add_argument("--local-rank", "--local_rank", type=int, default=None,
                   help="what torch.distributed.launch passes: the engine takes the rank's "
                        "device from LOCAL_RANK, which the launcher sets too (a value that "
                        "disagrees with it is refused); without a launcher, the device's index")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard fp32 master weights and optimizer state across the data-parallel "
                        "ranks of each stage (gradients reduce-scattered, new weights "
                        "all-gathered)")
    add_reduce_args(g)
    g.add_argument("--sequence-parallel", action="store_true",
                   help="with --tensor-model-parallel-size > 1: split norms, dropout and "
                        "residuals along the sequence (all-reduces become all-gather + "
                        "reduce-scatter; stage-to-stage messages shrink by t)")


def rank_order_of(args) -> str:
    """--rank-order, or Megatron's --use-tp-pp-dp-mapping (tp-pp-dp); tp-dp-pp by default."""
    if getattr(args, "use_tp_pp_dp_mapping", False):
        if args.rank_order not in (None, "tp-pp-dp"):
            raise ConfigError(f"--use-tp-pp-dp-mapping with --rank-order {args.rank_order}: "
                              "the mapping is --rank-order tp-pp-dp; give one of them")
        return "tp-pp-dp"
    return args.rank_order or "tp-dp-pp"


def partition_arg(value: str) -> tuple:
    """--pipeline-partition: comma-separated integers."""
    try:
        return tuple(int(x) for x in value.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated stage boundaries such as 0,3,6, got {value!r}") from None


def add_training_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="default: micro-batch size x data-parallel size (one microbatch)")
    g.add_argument("--train-iters", type=int, default=10)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--optimizer", choices=OPTIMIZERS, default="adam")
    g.add_argument("--optimizer-impl", choices=OPTIMIZER_IMPLS, default="auto",
                   help="the kernel that steps the optimizer: auto (default) = torch's fused "
                        "kernel where it runs, else apex's (CUDA, Adam), else unfused torch ops; "
                        "native = the C kernel for Adam on a CPU (built with cc on first use; "
                        "writes the 2BW compensation's prediction in the step's pass)")
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="Megatron's: a separate lr for the input embedding and the output layer "
                        "(both copies of a tied word embedding), on the same warmup and decay")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="the minimum of --decoupled-lr's decay (default: --min-lr; without "
                        "--decoupled-lr it has no effect, as in Megatron)")
    g.add_argument("--lr-decay-style", choices=LR_DECAY_STYLES, default="linear",
                   help="over --lr-decay-iters (default: --train-iters) down to --min-lr")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-init", type=float, default=0.0,
                   help="the lr the warmup starts from, rising linearly to --lr (Megatron's; "
                        "default 0)")
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-warmup-fraction", type=float, default=None,
                   help="warmup as a fraction of the decay span (Megatron's; excludes "
                        "--lr-warmup-iters/--lr-warmup-samples)")
    g.add_argument("--lr-warmup-samples", type=int, default=0,
                   help="warmup in samples (with --train-samples)")
    g.add_argument("--lr-decay-samples", type=int, default=None,
                   help="decay span in samples (with --train-samples; default: --train-samples)")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--clip-grad", type=float, default=1.0)
    add_precision_args(g)
    g.add_argument("--train-samples", type=int, default=None,
                   help="alternative to --train-iters: samples / global batch size iterations")
    add_ramp_args(g)
    g.add_argument("--eval-interval", type=int, default=1000,
                   help="evaluate on the validation split every N iterations (0: never)")
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--skip-train", action="store_true",
                   help="train nothing: evaluate --eval-iters validation batches on the weights "
                        "of --load (else the initial ones) and exit (Megatron's)")
    g.add_argument("--save", default=None)
    g.add_argument("--load", default=None)
    g.add_argument("--save-interval", type=int, default=None,
                   help="save every N iterations (default: only at the end, with --save)")
    g.add_argument("--keep-last", type=int, default=0,
                   help="keep only the newest N checkpoints (0: keep all)")
    g.add_argument("--ckpt-format", choices=CKPT_FORMATS, default=CKPT_FORMATS[0],
                   help="torch_dist: layout-free (loads into any t, d, w and schedule); torch: "
                        "Megatron's one file per stage and tensor rank (loads into the same "
                        "layout only); megatron: megatron-core's torch_dist names and layout, "
                        "which Megatron-LM's --load continues from (and this project too). "
                        "Loading reads any of them and Megatron-LM's own")
    g.add_argument("--async-save", action="store_true",
                   help="torch_dist: copy the state to host memory and write the checkpoint in "
                        "the background while training continues")
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", dest="load_rng", action="store_false",
                   help="on resume keep this process's RNG state (from --seed), not the "
                        "checkpoint's")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="take the model's shape and architecture from the newest checkpoint in "
                        "--load (Megatron's: they override the flags; said in one line)")
    g.add_argument("--exit-on-missing-checkpoint", action="store_true",
                   help="with --load: stop with one line when it holds no checkpoint, instead "
                        "of starting from scratch (also when --load equals --save)")
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-duration-in-mins", type=float, default=None)
    g.add_argument("--wall-clock-breakdown", action="store_true")
    g.add_argument("--trace", default=None, metavar="FILE",
                   help="record every action's start/end; each rank writes FILE.rank<r>.json "
                        "(tools/plot_schedule.py --trace FILE draws it)")
    add_observability_args(p)


def config_from_args(args: argparse.Namespace, family: str = "gpt") -> Config:
    """The typed config of parsed flags, as typed (not validated, not resolved for a world: the
    config pipeline, `config_pipeline.build_config`, does both)."""
    shape = dict(SHAPE_DEFAULTS)
    if getattr(args, "model", None):
        try:
            shape.update(flavour_shape(args.model, family))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    for key in shape:
        if getattr(args, key) is not None:
            shape[key] = getattr(args, key)
    if args.fp16 and args.bf16:
        raise ConfigError("--fp16 and --bf16 are mutually exclusive: pick one")
    method, num, granularity = recompute_from_args(args)
    model = ModelConfig(
        family=family, bert_binary_head=not getattr(args, "bert_no_binary_head", False), num_layers=shape["num_layers"], hidden_size=shape["hidden_size"],
        num_attention_heads=shape["num_attention_heads"], ffn_hidden_size=args.ffn_hidden_size,
        seq_length=shape["seq_length"], max_position_embeddings=args.max_position_embeddings,
        vocab_size=MOCK_VOCAB_SIZE if args.vocab_size is None else args.vocab_size,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout, init_method_std=args.init_method_std,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        eod_mask_loss=getattr(args, "eod_mask_loss", False),
        reset_position_ids=getattr(args, "reset_position_ids", False),
        reset_attention_mask=getattr(args, "reset_attention_mask", False),
        recompute_method=method, recompute_num_layers=num or 0,
        recompute_granularity=granularity)
    model = mds_model(apply_architecture_args(model, args), args)
    parallel = ParallelConfig(
        tensor=args.tensor_model_parallel_size, pipeline=args.pipeline_model_parallel_size,
        data=args.data_parallel_size, rank_order=rank_order_of(args),
        partition=getattr(args, "pipeline_partition", None),
        backend=args.distributed_backend, timeout_minutes=args.distributed_timeout_minutes,
        distributed_optimizer=getattr(args, "use_distributed_optimizer", False),
        sequence_parallel=getattr(args, "sequence_parallel", False), **reduce_config(args))
    batch = BatchConfig(micro_batch_size=args.micro_batch_size, **ramp_fields(args))
    optimizer = OptimizerConfig(
        name=args.optimizer, lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum, clip_grad=args.clip_grad,
        lr_warmup_iters=args.lr_warmup_iters, lr_decay_iters=args.lr_decay_iters,
        lr_warmup_init=getattr(args, "lr_warmup_init", 0.0),
        lr_decay_style=args.lr_decay_style, impl=getattr(args, "optimizer_impl", "auto"),
        lr_warmup_fraction=getattr(args, "lr_warmup_fraction", None),
        lr_warmup_samples=getattr(args, "lr_warmup_samples", 0),
        lr_decay_samples=getattr(args, "lr_decay_samples", None),
        lr_warmup_tokens=getattr(args, "lr_warmup_tokens", None),
        lr_decay_tokens=getattr(args, "lr_decay_tokens", None),
        decoupled_lr=getattr(args, "decoupled_lr", None),
        decoupled_min_lr=getattr(args, "decoupled_min_lr", None))
    precision = precision_from_args(args)
    train = TrainConfig(
        train_iters=args.train_iters, seed=args.seed, log_interval=args.log_interval,
        eval_interval=args.eval_interval, eval_iters=args.eval_iters, save=args.save,
        skip_train=getattr(args, "skip_train", False),
        load=args.load, save_interval=args.save_interval or 0, keep_last=args.keep_last,
        save_optim=not args.no_save_optim, ckpt_format=args.ckpt_format,
        async_save=args.async_save,
        load_optim=not args.no_load_optim, finetune=args.finetune,
        override_opt_param_scheduler=bool(getattr(args, "override_opt_param_scheduler",
                                                  None)),
        load_rng=getattr(args, "load_rng", True),
        exit_interval=args.exit_interval or 0,
        exit_duration_in_mins=args.exit_duration_in_mins or 0.0,
        **logger_fields(args), wall_clock_breakdown=args.wall_clock_breakdown,
        trace=args.trace, tensorboard_dir=args.tensorboard_dir,
        tensorboard_queue_size=args.tensorboard_queue_size,
        tensorboard_log_interval=getattr(args, "tensorboard_log_interval", 1),
        log_timers_to_tensorboard=args.log_timers_to_tensorboard, profile=args.profile,
        profile_step_start=args.profile_step_start, profile_step_end=args.profile_step_end,
        profile_ranks=tuple(args.profile_ranks), log_straggler=args.log_straggler,
        straggler_threshold=args.straggler_threshold,
        log_params_norm=getattr(args, "log_params_norm", False),
        num_workers=getattr(args, "num_workers", None),
        check_for_nan_in_loss_and_grad=args.check_for_nan_in_loss_and_grad)
    return Config(model=model, parallel=parallel, batch=batch, optimizer=optimizer,
                  precision=precision, train=train, **schedule_fields(args))


def recompute_from_args(args) -> tuple:
    """(recompute_method, recompute_num_layers, recompute_granularity) of the recompute flags,
    with Megatron's meanings: --recompute-activations is selective recomputation."""
    method, num = args.recompute_method, args.recompute_num_layers
    granularity = args.recompute_granularity
    if args.recompute_activations:
        if granularity == "full":
            raise ConfigError("--recompute-activations means selective recomputation (core "
                              "attention), --recompute-granularity full whole layers: give one")
        granularity = "selective"
    if granularity == "full":
        if method is None:
            raise ConfigError("--recompute-granularity full needs --recompute-method "
                              "{uniform,block} (and --recompute-num-layers N, default 1)")
        num = 1 if num is None else num  # Megatron's default
    elif method is not None or num is not None:
        raise ConfigError("--recompute-method/--recompute-num-layers need "
                          "--recompute-granularity full")
    return method, num, granularity


def exit_on_config_error(fn):
    """Run fn(); on ConfigError print one line to stderr and exit 2 (before any process group)."""
    try:
        return fn()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
