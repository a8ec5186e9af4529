"""Run a function on N local processes (gloo on CPU): used by commands (compare_convergence), the
judges (testing/verify.py) and tests.

If any rank raises, the others are terminated and the error is re-raised in the caller, so a
failing rank never leaves the rest hanging.

The ranks are forked from a forkserver that imported torch and the package once (`PRELOAD`):
each is a fresh process (no threads, nothing run, its own process group) with the caller's
environment and working directory of the moment, as a spawned one has, started in
milliseconds instead of re-importing torch for seconds. The forkserver exits with the process
that started it, and the ranks with it (`watch_launcher`).
"""
from __future__ import annotations

import datetime
import multiprocessing
import os
import socket

import torch.multiprocessing as mp

from megatron_2bw.parallel.distributed import destroy_process_group, start_process_group
from megatron_2bw.training.reliability import watch_launcher


PRELOAD = ["torch", "torch.distributed", "torch.nn.functional", "torch._dynamo",
           "megatron_2bw.training.loop"]


def _forkserver() -> str:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return "forkserver"


def free_port() -> int:
    """A port free now, for a child process that binds it itself (torchrun, a CLI run): another
    process may take it in between, so runs started here use `host_store` instead."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_store(world_size: int, timeout_minutes: float):
    """The rendezvous store, hosted by the launching process on a port the OS gives it and held
    for the whole run; the ranks connect to it (`connect_store`). No port is freed and bound
    again later, where a test running alongside could take it first (EADDRINUSE)."""
    import torch.distributed as dist
    return dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(minutes=timeout_minutes))


def connect_store(port: int, world_size: int, timeout_minutes: float):
    """A rank's client of `host_store`'s store."""
    import torch.distributed as dist
    return dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                         timeout=datetime.timedelta(minutes=timeout_minutes))


def _worker(rank, world_size, port, backend, timeout_minutes, fn, args, env, cwd):
    os.environ.clear()  # the caller's environment and directory now, as a spawned process has
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    os.chdir(cwd)
    import torch
    torch.set_num_threads(1)
    watch_launcher()  # the spawning process dies: this worker exits too
    start_process_group(rank, world_size, local_rank=rank, backend=backend,
                        timeout_minutes=timeout_minutes,
                        store=connect_store(port, world_size, timeout_minutes))
    try:
        fn(rank, world_size, *args)
    finally:
        destroy_process_group()


def spawn(fn, world_size: int, args: tuple = (), backend: str = "gloo",
          timeout_minutes: float = 2.0) -> None:
    """fn(rank, world_size, *args) on world_size processes; fn must be importable (picklable)."""
    store = host_store(world_size, timeout_minutes)  # held until every rank has exited
    mp.start_processes(_worker, args=(world_size, store.port, backend, timeout_minutes, fn,
                                      args, dict(os.environ), os.getcwd()),
                       nprocs=world_size, join=True, start_method=_forkserver())
    del store
