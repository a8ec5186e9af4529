"""What the launcher (torchrun, DeepSpeed's `deepspeed`, srun, mpirun, torch multiprocessing) told
this process beyond its rank and world (config/launcher_env.py `env_rank_world`): whether a
launcher started it, its --local-rank, the ranks of its node, SLURM's host list, and the
rendezvous address when no torchrun set one. Environment reading (and `scontrol show hostnames`
where SLURM is installed): no torch, no process group."""
from __future__ import annotations

import os
import shutil
import subprocess

from megatron_2bw.config import ConfigError
from megatron_2bw.config.launcher_env import LAUNCHER_VARS, env_int

MPI_VARS = LAUNCHER_VARS[2:]
# DeepSpeed's launcher (deepspeed.launcher.launch, under `deepspeed --num_gpus N ...`) sets RANK,
# WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT as torchrun does, passes --local_rank=N, and names
# the node and its processes: (node index, nodes, processes on this node)
DEEPSPEED_VARS = ("CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE")

LOCAL_RANK_FLAGS = ("--local-rank", "--local_rank")


def local_rank_problem(argv, given: int | None, local_rank: int) -> str | None:
    """Why the command line's --local-rank cannot stand, or None: given twice (the launcher's
    --local-rank=N and one typed after it: every rank says so, so none starts a process group),
    or disagreeing with the launcher's LOCAL_RANK."""
    argv = list(argv)
    seen = [a if "=" in a else f"{a} {argv[i + 1] if i + 1 < len(argv) else ''}".strip()
            for i, a in enumerate(argv) if a.split("=", 1)[0] in LOCAL_RANK_FLAGS]
    if len(seen) > 1:
        return (f"--local-rank is given {len(seen)} times ({', '.join(seen)}): the launcher "
                "(torch.distributed.launch) passes each process its own; drop the one on your "
                "command line")
    if given is not None and launched() and given != local_rank:
        return (f"--local-rank {given} disagrees with the launcher's local rank {local_rank} "
                "(LOCAL_RANK): drop --local-rank")
    return None


def check_rendezvous(world_size: int, env=None) -> None:
    """A rendezvous the ranks cannot complete, refused before any process group (it would wait
    out the group timeout): MASTER_PORT=0 with several ranks (a launcher's --master_port 0), where
    rank 0 would listen on a port the others are never told."""
    env = os.environ if env is None else env
    if world_size > 1 and env.get("MASTER_PORT", "").strip() == "0":
        raise ConfigError("MASTER_PORT=0 (--master_port 0): the other ranks cannot find rank 0's "
                          "port; give a free port, or launch with torchrun --standalone")


def launched() -> bool:
    """True when a launcher (torchrun, srun, mpirun, torch multiprocessing) started this process,
    i.e. its rank variables are set; False for a plain `python pretrain_gpt.py` from a shell."""
    return any(r in os.environ and w in os.environ for r, w, _, _ in LAUNCHER_VARS)


def node_ranks(rank: int, local_rank: int) -> list[int] | None:
    """The global ranks that share this process's node, where the launcher says so: torchrun
    numbers a node's workers contiguously (rank - local rank onwards, LOCAL_WORLD_SIZE of them);
    a plain `srun` names them in SLURM_GTIDS, whatever the task distribution (block, cyclic,
    plane); DeepSpeed's launcher numbers them contiguously too (LOCAL_SIZE of them). None when
    no launcher says (mpirun's mapping, a hand-made environment)."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env or "GROUP_RANK" in env:  # torchrun's workers
        first = rank - local_rank
        return list(range(first, first + env_int(env, "LOCAL_WORLD_SIZE", local_rank + 1)))
    if all(v in env for v in DEEPSPEED_VARS):  # DeepSpeed's launcher: a node's ranks in a row
        first = rank - local_rank
        return list(range(first, first + env_int(env, "LOCAL_SIZE", 1)))
    if "SLURM_GTIDS" in env and env.get("SLURM_PROCID") == str(rank):  # srun, one task a rank
        try:
            return [int(x) for x in env["SLURM_GTIDS"].split(",")]
        except ValueError:
            return None
    return None


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list as host names, in `scontrol show hostnames` order: a comma
    list of names, each literal text and bracket groups of numbers and ranges, zero padding
    kept (`gpu[01-03,07],login1`, `a[1-2]-ib`, `rack[1-2]-n[01-02]`: rack1-n01, rack1-n02,
    rack2-n01, rack2-n02, the first group varying slowest). The parser behind `slurm_hosts`."""
    hosts, depth, item = [], 0, ""
    for ch in nodelist.strip() + ",":
        if ch == "," and depth == 0:
            if item:
                hosts += _expand_host(item, nodelist)
            item = ""
            continue
        depth += (ch == "[") - (ch == "]")
        if depth not in (0, 1):
            raise ConfigError(f"SLURM host list {nodelist!r}: unbalanced brackets; expected "
                              "names like gpu[01-04,07],login1")
        item += ch
    if depth:
        raise ConfigError(f"SLURM host list {nodelist!r}: unbalanced brackets; expected "
                          "names like gpu[01-04,07],login1")
    return hosts


def _expand_host(item: str, nodelist: str) -> list[str]:
    """One name of a host list, its bracket groups expanded (first group slowest)."""
    names = [""]
    while item:
        cut = item.find("[")
        if cut != 0:  # literal text up to the next group (or the end)
            cut = len(item) if cut < 0 else cut
            names, item = [n + item[:cut] for n in names], item[cut:]
            continue
        group, _, item = item[1:].partition("]")
        values = []
        for part in group.split(","):
            lo, dash, hi = part.partition("-")
            if not lo.isdigit() or (dash and not hi.isdigit()) or (dash and int(hi) < int(lo)):
                raise ConfigError(f"SLURM host list {nodelist!r}: [{group}] is not a list of "
                                  "numbers and ranges lo-hi (e.g. [01-04,07])")
            values += [f"{x:0{len(lo)}d}" for x in range(int(lo), int(hi or lo) + 1)]
        names = [n + v for n in names for v in values]
    return names


def slurm_hosts(nodelist: str) -> list[str]:
    """The host names of a SLURM host list: `scontrol show hostnames` where SLURM is installed
    (it knows every form the cluster uses), else (or when it fails) `expand_nodelist`."""
    scontrol = shutil.which("scontrol")
    if scontrol:
        try:
            out = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True,
                                 text=True, timeout=30)
            if out.returncode == 0 and out.stdout.split():
                return out.stdout.split()
        except (OSError, subprocess.SubprocessError):
            pass
    return expand_nodelist(nodelist)


def slurm_port(job_id: str | int) -> int:
    """The rendezvous port of SLURM job `job_id`: 20000 + job_id % 20000 (20000-39999), so two
    jobs that share a node do not collide; the batch scripts use the same formula."""
    return 20000 + int(job_id) % 20000


def slurm_rendezvous() -> None:
    """Under plain `srun python ...` (no torchrun): MASTER_ADDR = the first host of the job by
    name, MASTER_PORT = slurm_port(SLURM_JOB_ID), each unless already set."""
    nodes = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if nodes and "MASTER_ADDR" not in os.environ:
        os.environ["MASTER_ADDR"] = slurm_hosts(nodes)[0]
    if "SLURM_JOB_ID" in os.environ and "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(slurm_port(os.environ["SLURM_JOB_ID"]))


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
