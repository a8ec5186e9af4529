"""What the launcher (torchrun, srun, mpirun, torch multiprocessing) told this process: its rank,
the world size and its local rank (`LAUNCHER_VARS`, the one list of the variables every launcher
sets), SLURM's host list, and the rendezvous address when no torchrun set one. Pure environment
reading: no torch, no process group."""
from __future__ import annotations

import os

from megatron_2bw.config import ConfigError

# (rank, world size, local rank, processes on this node) as each launcher names them
LAUNCHER_VARS = (("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),  # torchrun, torch mp
                 ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
                 ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                  "OMPI_COMM_WORLD_LOCAL_SIZE"),                            # Open MPI
                 ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"))  # MPICH, Intel
MPI_VARS = LAUNCHER_VARS[2:]


def env_rank_world() -> tuple[int, int, int]:
    """(rank, world_size, local_rank) from torchrun, SLURM or MPI variables; (0, 1, 0) if none."""
    for rank_var, world_var, local_var, _ in LAUNCHER_VARS:
        if rank_var in os.environ and world_var in os.environ:
            return (int(os.environ[rank_var]), int(os.environ[world_var]),
                    int(os.environ.get(local_var, 0)))
    return 0, 1, 0


def launched() -> bool:
    """True when a launcher (torchrun, srun, mpirun, torch multiprocessing) started this process,
    i.e. its rank variables are set; False for a plain `python pretrain_gpt.py` from a shell."""
    return any(r in os.environ and w in os.environ for r, w, _, _ in LAUNCHER_VARS)


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list ("gpu[01-03,07],login1") as host names, like
    `scontrol show hostnames`."""
    hosts, i, n = [], 0, len(nodelist)
    while i < n:
        j = i
        while j < n and nodelist[j] not in ",[":
            j += 1
        prefix = nodelist[i:j]
        if j < n and nodelist[j] == "[":
            k = nodelist.index("]", j)
            for part in nodelist[j + 1:k].split(","):
                lo, _, hi = part.partition("-")
                if hi:
                    hosts += [f"{prefix}{x:0{len(lo)}d}" for x in range(int(lo), int(hi) + 1)]
                else:
                    hosts.append(prefix + lo)
            j = k + 1
        elif prefix:
            hosts.append(prefix)
        i = j + 1 if j < n and nodelist[j] == "," else j
    return hosts


def slurm_rendezvous() -> None:
    """Under plain `srun python ...` (no torchrun): MASTER_ADDR = first host of the job,
    MASTER_PORT derived from the job id, unless already set."""
    if "SLURM_JOB_NODELIST" in os.environ and "MASTER_ADDR" not in os.environ:
        os.environ["MASTER_ADDR"] = expand_nodelist(os.environ["SLURM_JOB_NODELIST"])[0]
    if "SLURM_JOB_ID" in os.environ and "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(20000 + int(os.environ["SLURM_JOB_ID"]) % 20000)


def discover_env(port: int) -> None:
    """Fill RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT from SLURM or MPI variables when a
    launcher other than torchrun started us (torchrun sets them all already)."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        env.setdefault("LOCAL_RANK", "0")
    elif "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        env["RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_NTASKS"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        slurm_rendezvous()  # first host of the job, port from the job id
        nodes = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if "MASTER_ADDR" not in env and nodes:
            hosts = expand_nodelist(nodes.strip())
            env["MASTER_ADDR"] = hosts[0] if hosts else nodes
    else:
        for r, w, lr, ls in MPI_VARS:
            if r in env and w in env:
                env["RANK"], env["WORLD_SIZE"] = env[r], env[w]
                env["LOCAL_RANK"] = env.get(lr, "0")
                if "MASTER_ADDR" not in env:
                    if env.get(ls, env[w]) != env[w]:
                        raise ConfigError("multi-node MPI launch without MASTER_ADDR: export "
                                          "MASTER_ADDR=<first node> (and MASTER_PORT)")
                break
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(port))
