"""Megatron's logging, profiling and numerics flags (TensorBoard, wandb, the profiler, the
straggler report, the NaN check); `flags.add_training_args` adds them, `logger_fields` gives the
TrainConfig fields of the wandb flags and --log-throughput."""
from __future__ import annotations

import argparse


def add_observability_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging, profiling and numerics (Megatron's flags)")
    g.add_argument("--tensorboard-dir", default=None,
                   help="write the logged scalars as TensorBoard events here (last stage)")
    g.add_argument("--tensorboard-queue-size", type=int, default=1000)
    g.add_argument("--tensorboard-log-interval", type=int, default=1,
                   help="write the per-iteration scalars (lm loss, learning-rate, batch-size) "
                        "every N iterations (Megatron's)")
    g.add_argument("--log-timers-to-tensorboard", action="store_true",
                   help="add the per-action wall-clock breakdown to TensorBoard")
    g.add_argument("--log-throughput", action="store_true",
                   help="add Megatron's `throughput per GPU (TFLOP/s/GPU)` (model FLOPs) to "
                        "each log line (TensorBoard and wandb always get `throughput`)")
    g.add_argument("--wandb-project", default=None,
                   help="log to this wandb project (offline unless WANDB_MODE says otherwise)")
    g.add_argument("--wandb-exp-name", default=None, help="the wandb run's name")
    g.add_argument("--wandb-entity", default=None,
                   help="the wandb team or user the run belongs to (wandb's default: yours)")
    g.add_argument("--wandb-save-dir", default=None,
                   help="where wandb's files go (default: {save}/wandb)")
    g.add_argument("--profile", action="store_true",
                   help="torch.profiler trace (Chrome/Perfetto JSON) of the iterations after "
                        "--profile-step-start up to --profile-step-end, per rank of "
                        "--profile-ranks, into {tensorboard-dir or save or .}/profile")
    g.add_argument("--use-pytorch-profiler", action="store_true",
                   help="accepted for Megatron scripts: --profile always uses torch.profiler")
    g.add_argument("--profile-step-start", type=int, default=10)
    g.add_argument("--profile-step-end", type=int, default=12)
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0])
    g.add_argument("--log-params-norm", action="store_true",
                   help="add the L2 norm of all weights to each log line (`params norm`) and "
                        "TensorBoard (`params-norm`): one all-reduce per log interval")
    g.add_argument("--log-straggler", action="store_true",
                   help="report every rank's compute and wait time per log interval and name "
                        "the slowest rank when above --straggler-threshold")
    g.add_argument("--straggler-threshold", type=float, default=20.0, metavar="PERCENT",
                   help="name a rank whose compute time is this many percent above the median")
    g.add_argument("--check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_true", default=True,
                   help="(default) stop at a non-finite loss or gradient norm (fp32/bf16; fp16 "
                        "skips such steps), naming the iteration and the stages")
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action="store_false")


def logger_fields(args: argparse.Namespace) -> dict:
    """The TrainConfig fields of the wandb flags and --log-throughput."""
    return dict(wandb_project=args.wandb_project, wandb_exp_name=args.wandb_exp_name,
                wandb_save_dir=args.wandb_save_dir,
                wandb_entity=getattr(args, "wandb_entity", None),
                log_throughput=bool(getattr(args, "log_throughput", False)))
