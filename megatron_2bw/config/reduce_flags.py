"""The data-parallel reduction flags (Megatron's --ddp-bucket-size and --overlap-grad-reduce,
plus --no-overlap-grad-reduce) and the ParallelConfig fields they fill (pipeline/grad_reduce.py
runs them); config/flags.py adds them to the parallel group."""
from __future__ import annotations


def add_reduce_args(g) -> None:
    g.add_argument("--ddp-bucket-size", dest="grad_bucket_size", type=int, default=None,
                   help="parameters (elements) per bucket of the data-parallel gradient "
                        "reduction (default: Megatron's max(40M, 1M x data-parallel size)); "
                        "buckets hold whole parameters")
    g.add_argument("--overlap-grad-reduce", dest="overlap_grad_reduce", action="store_true",
                   default=True,
                   help="start each bucket's reduction as soon as the batch's last backward "
                        "has produced it (the default here; Megatron's flag is accepted)")
    g.add_argument("--no-overlap-grad-reduce", dest="overlap_grad_reduce", action="store_false",
                   help="start every bucket's reduction after the batch's last backward (the "
                        "same numbers)")


def reduce_config(args) -> dict:
    """The ParallelConfig fields of these flags."""
    return dict(grad_bucket_size=getattr(args, "grad_bucket_size", None),
                overlap_grad_reduce=getattr(args, "overlap_grad_reduce", True))
