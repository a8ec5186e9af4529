"""The precision flags (Megatron's names, plus --grad-accumulation) and the PrecisionConfig they
fill; config/flags.py adds them to the training group."""
from __future__ import annotations

import argparse

from megatron_2bw.config.choices import GRAD_ACCUMULATIONS
from megatron_2bw.config.schema import PrecisionConfig


def add_precision_args(g) -> None:
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--grad-accumulation", choices=GRAD_ACCUMULATIONS, default="fp32",
                   help="bf16/fp16: fp32 (default, Megatron's main_grad): each parameter's "
                        "gradient is added into the fp32 gradient buffer as backward computes "
                        "it; buffer: backward fills a stage-sized bf16/fp16 buffer that is added "
                        "into fp32 after every microbatch (2 bytes per parameter more, no "
                        "per-parameter hook; the same numbers)")
    g.add_argument("--no-tf32", dest="tf32", action="store_false",
                   help="on CUDA keep fp32 matmuls and convolutions in IEEE fp32 (default: TF32 "
                        "tensor cores, as the pretrain scripts set on Ampere and newer)")
    g.add_argument("--loss-scale", type=float, default=None)
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--max-skipped-steps", type=int, default=None,
                   help="fp16: end the run with an error after this many consecutive skipped "
                        "(overflowing) steps; 0: no limit (default: the skips the loss scale "
                        "needs to fall from --initial-loss-scale to --min-loss-scale, plus 10)")


def precision_from_args(args: argparse.Namespace) -> PrecisionConfig:
    return PrecisionConfig(
        dtype="fp16" if args.fp16 else ("bf16" if args.bf16 else "fp32"),
        loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale, loss_scale_window=args.loss_scale_window,
        hysteresis=args.hysteresis, max_skipped_steps=args.max_skipped_steps, tf32=args.tf32,
        grad_accumulation=getattr(args, "grad_accumulation", "fp32"))


__all__ = ["add_precision_args", "precision_from_args"]
