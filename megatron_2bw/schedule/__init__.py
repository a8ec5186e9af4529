"""Pipeline schedules as data: PURE, no torch, no process groups, nothing of the package
but itself (tests/unit/test_layout.py checks that nothing here imports torch).

Owns: the action vocabulary (actions.py: F/B, ra/sa/rg/sg, R/N/S and their printable forms),
the table generators (generators.py), the schedule registry and every rule a schedule implies
(kinds.py: gpipe, flush, 2bw, forward; slots, versions, m >= d, in flight, segments), the 2BW
compensation methods and what each needs (compensation_methods.py), the lazy
per-stage tables of a (kind, d, m, segment) (tables.py), the event-driven simulator that is also
the validator (simulate.py: deadlock-free, dependencies, versions), the NCCL-order validator
(nccl_posts.py: what every rank posts and waits for, as the engine runs a table; nccl_order.py:
the replay under NCCL's in-order-per-communicator semantics, which proves there is no wait cycle
or prints it, and decides where the engine may post receives early) and the text grid
(render.py). The engine runs these tables, the planner times them, tools draw them.
Must not import: config, pipeline, models, tensor_parallel, parallel, optim, data, checkpoint,
training, planner, deepspeed, testing, pretrain, generate, fs, pipe.
"""

from megatron_2bw.schedule.nccl_order import (NcclOrderError, NcclReport, check_nccl_order,
                                              early_receives_safe)
from megatron_2bw.schedule.comm_layout import CommLayout

__all__ = ["CommLayout", "NcclOrderError", "NcclReport", "check_nccl_order",
           "early_receives_safe"]
