"""The schedule flags (--pipeline-schedule and what refines it: --2bw-compensation,
--2bw-grad-buffers, --gpipe-microbatches-per-flush) and the Config fields they fill;
config/flags.py adds them to the parallelism group."""
from __future__ import annotations

import argparse

from megatron_2bw.config.choices import SCHEDULES
from megatron_2bw.schedule.compensation_methods import NONE as NO_COMPENSATION, method_names
from megatron_2bw.schedule.kinds import DEFAULT_SCHEDULE, FIRST_STAGE, default_schedule


def add_schedule_args(g) -> None:
    g.add_argument("--pipeline-schedule", choices=SCHEDULES, default=None,
                   help=f"default: {default_schedule(1)} at one pipeline stage (a delayed "
                        f"gradient gains nothing there), else {DEFAULT_SCHEDULE}")
    g.add_argument("--2bw-compensation", dest="compensation", choices=method_names(),
                   default=NO_COMPENSATION,
                   help="2BW staleness compensation: predict = each batch runs forward and "
                        "backward on the optimizer's prediction of the weights it would run on "
                        "synchronously (bf16/fp16: no extra memory; fp32: one stage-sized "
                        "buffer); predict-spike = predict plus spike compensation of Adam's "
                        "momentum (ahead of GPipe at the usual settings); predict-nesterov = "
                        "predict whose Adam update also takes the latest gradient (Nesterov "
                        "form; the optimizer keeps it: one more stage-sized fp32 buffer; "
                        "closest to GPipe at high constant lr; bench/README.md); "
                        "none = plain 2BW (docs/ARCHITECTURE.md section 1)")
    g.add_argument("--2bw-grad-buffers", dest="grad_buffers", type=grad_buffers_arg,
                   default=None,
                   help="2bw's fp32 gradient buffers per stage: 2 (default) = one per version; "
                        "1 = one stage-sized buffer less, S(t) before batch t+1's first backward "
                        "(it waits for batch t's grad norm there); first = one on the first "
                        "stage (the one with the most microbatches in flight, which posts the "
                        "norm last: about no wait), two on the others; the same numbers always")
    g.add_argument("--gpipe-microbatches-per-flush", dest="microbatches_per_flush", type=int,
                   default=None, metavar="K",
                   help="gpipe only: run each batch as pipeline flushes of at most K "
                        "microbatches (K microbatches' activations in flight instead of all "
                        "m; the gradients accumulate, one step per batch: the same numbers), "
                        "as GPipe must when m stashes do not fit; default: one flush of all m")


def grad_buffers_arg(value: str):
    """--2bw-grad-buffers: an integer, or `first` (schedule/kinds.py FIRST_STAGE)."""
    if value == FIRST_STAGE:
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 2, 1 or {FIRST_STAGE}, got {value!r}") \
            from None


def schedule_given(args) -> bool:
    """Whether the flags ask for a schedule (--2bw-compensation asks for 2BW)."""
    return (getattr(args, "pipeline_schedule", None) is not None
            or getattr(args, "compensation", NO_COMPENSATION) != NO_COMPENSATION)


def schedule_of_args(args) -> str:
    if not schedule_given(args):
        return default_schedule(args.pipeline_model_parallel_size)
    return args.pipeline_schedule or DEFAULT_SCHEDULE


def schedule_fields(args) -> dict:
    """Config(schedule=, compensation=, grad_buffers=, microbatches_per_flush=) of the flags."""
    return dict(schedule=schedule_of_args(args),
                compensation=getattr(args, "compensation", NO_COMPENSATION),
                grad_buffers=getattr(args, "grad_buffers", None),
                microbatches_per_flush=getattr(args, "microbatches_per_flush", None))


__all__ = ["add_schedule_args", "schedule_fields", "grad_buffers_arg", "schedule_given",
           "schedule_of_args"]
