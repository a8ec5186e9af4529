"""Megatron's logging, profiling and numerics flags (TensorBoard, the profiler, the straggler
report, the NaN check); `flags.add_training_args` adds them."""
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
