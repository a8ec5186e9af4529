"""What the launcher (torchrun, DeepSpeed's `deepspeed`, srun, mpirun, torch multiprocessing) told
this process about the world: its rank, the world size and its local rank (`env_rank_world`), from
`LAUNCHER_VARS`, the one list of the variables every launcher sets. Environment reading only (no
torch, no process group): the config reads the world size it validates for from here before
anything starts; parallel/launcher.py reads the rest of the launcher's environment.
"""
from __future__ import annotations

import os

from megatron_2bw.config.choices import ConfigError

# (rank, world size, local rank, processes on this node) as each launcher names them
LAUNCHER_VARS = (("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),  # torchrun, torch mp
                 ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
                 ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                  "OMPI_COMM_WORLD_LOCAL_SIZE"),                            # Open MPI
                 ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"))  # MPICH, Intel


def env_int(env, var: str, default: str | None = None) -> int:
    """The launcher's variable `var` (or `default`) as an integer, else a one-line ConfigError."""
    value = env.get(var, default)
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{var}={value!r} is not an integer (the launcher's variables, or the "
                          f"shell's): unset {var} for one process, or launch with torchrun / "
                          "srun") from None


def env_rank_world(env=None) -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun, SLURM or MPI variables; (0, 1, 0) if none.
    Variables that are no integers, or a rank outside the world, are a one-line ConfigError."""
    env = os.environ if env is None else env
    for rank_var, world_var, local_var, _ in LAUNCHER_VARS:
        if rank_var in env and world_var in env:
            rank, world = env_int(env, rank_var), env_int(env, world_var)
            local = env_int(env, local_var, "0")
            if world < 1 or not 0 <= rank < world or local < 0:
                raise ConfigError(f"{rank_var}={rank} {world_var}={world} {local_var}={local}: "
                                  f"the rank must be in 0..{world_var}-1 and the local rank >= "
                                  f"0; unset them for one process, or launch with torchrun / "
                                  "srun")
            return rank, world, local
    return 0, 1, 0


__all__ = ["LAUNCHER_VARS", "env_int", "env_rank_world"]
