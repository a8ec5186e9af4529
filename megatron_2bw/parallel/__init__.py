"""Processes and their communication: the only package that calls torch.distributed.

Owns: `Comm` (comm.py: the one door to torch.distributed, every collective and p2p call, each tensor
on the device its backend communicates on), the process grid (grid.py: `ProcessGrid.from_config`,
(tensor, pipeline, data) coordinates, rank order, the groups, the tied-weight groups, a rank's name
in messages: `describe`), point-to-point between neighbouring stages (p2p.py), starting the process
group (distributed.py: `start_process_group`), backend and device choice (devices.py) and what the
launcher told this process beyond its rank and world (launcher.py: torchrun / SLURM / mpirun
variables, no torch; rank and world: config/launcher_env.py).
Must not import: schedule, pipeline, models, tensor_parallel, optim, data, checkpoint, training,
planner, deepspeed, testing, pretrain, generate.
"""
from megatron_2bw.parallel.grid import ProcessGrid

__all__ = ["ProcessGrid"]
