"""What decides a rank's communication besides its schedule table (`CommLayout`), and the grid's
rank arithmetic without torch (`rank_of`): the inputs of the NCCL-order validator
(nccl_posts.py, nccl_order.py) and of the planner's placement. PURE."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CommLayout:
    """What decides a rank's communication besides its table: the tensor and data-parallel sizes
    (the pipeline size is the schedule's), the rank order and the options that add collectives."""
    tensor: int = 1
    data: int = 1
    rank_order: str = "tp-dp-pp"
    tied: bool = True                   # tied embeddings: the first and last stage all-reduce
    distributed_optimizer: bool = False  # reduce-scatter, world norm, all-gather after S
    sequence_parallel: bool = False     # R all-reduces part of the gradient over tp first
    compensation: bool = False          # a predicting 2BW compensation (views re-publish)
    views: bool = False                 # a view (eval / checkpoint) between every two windows
    split_pairs: bool = True            # a group per direction of a stage pair (NCCL's layout)
    early_receives: bool = True         # post the next group's receives early
    lazy_p2p_init: bool = True          # a pair communicator's first post blocks both ranks
                                        # until both reach it (NCCL may create p2p lazily)
    shapes: str = "batch"               # which microbatches carry a header (actions.SHAPE_MODES)
    early_reduce: bool = False          # R(t)'s data-parallel buckets start in the stage's
                                        # last backward of batch t (pipeline/grad_reduce.py)

    def __post_init__(self):
        for name in ("tensor", "data"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"CommLayout.{name} must be an integer >= 1, got {value!r}")
        if self.rank_order not in ("tp-dp-pp", "tp-pp-dp"):
            raise ValueError(f"CommLayout.rank_order {self.rank_order!r}: use 'tp-dp-pp' or "
                             "'tp-pp-dp'")

    @property
    def sharded(self) -> bool:
        return self.distributed_optimizer and self.data > 1


def rank_of(tp: int, pp: int, dp: int, t: int, d: int, w: int, order: str) -> int:
    """The global rank of (tp, pp, dp) at t x d x w in rank order `order`: parallel/grid.py's
    arithmetic, pure, for this validator and the planner (tests check the three agree)."""
    return tp + t * (dp + w * pp) if order == "tp-dp-pp" else tp + t * (pp + d * dp)


__all__ = ["CommLayout", "rank_of"]
