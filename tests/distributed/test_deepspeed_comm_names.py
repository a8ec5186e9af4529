"""The drop-in's `deepspeed.comm` against the installed DeepSpeed's: every public function and
class of deepspeed.comm (defined in its package: comm.py, utils.py, reduce_op.py and the backend
modules; not torch's or typing's names it re-exports) is provided, taking DeepSpeed's parameters
by name, or refused in one line naming what to use; the backend names are DeepSpeed's. Then
DeepSpeed's own distributed test harness's calls (tests/unit/common.py of deepspeedai/DeepSpeed:
init_distributed with a file:// rendezvous, barrier, all_gather_into_tensor, and at every
teardown barrier + destroy_process_group) on gloo processes."""
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch

import megatron_2bw.deepspeed.comm as ours
from megatron_2bw.config import ConfigError
from megatron_2bw.training.spawn import spawn

# read in a process of its own: the real deepspeed must not share this one with the drop-in
READ = r'''
import inspect, json, deepspeed.comm as c
out = {"functions": {}, "classes": [], "constants": {}}
for name in dir(c):
    obj = getattr(c, name)
    module = getattr(obj, "__module__", None) or ""
    if name.startswith("_") or inspect.ismodule(obj) or not module.startswith("deepspeed.comm"):
        continue
    if inspect.isclass(obj):
        out["classes"].append(name)
    elif inspect.isfunction(obj):
        params = inspect.signature(obj).parameters.values()
        out["functions"][name] = [p.name for p in params
                                  if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
for name in ("NCCL_BACKEND", "GLOO_BACKEND", "MPI_BACKEND", "CCL_BACKEND", "HCCL_BACKEND",
             "SCCL_BACKEND", "TORCH_DISTRIBUTED_DEFAULT_PORT"):
    out["constants"][name] = getattr(c, name)
out["timeout_s"] = c.default_pg_timeout.total_seconds()
print("NAMES " + json.dumps(out))
'''

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="deepspeed is not installed")


def installed_names() -> dict:
    proc = subprocess.run([sys.executable, "-c", READ], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("NAMES ")][-1]
    return json.loads(line[len("NAMES "):])


def test_every_public_name_of_the_installed_deepspeed_comm_is_provided_or_refused():
    real = installed_names()
    names = set(real["functions"]) | set(real["classes"])
    assert {"destroy_process_group", "all_gather_into_tensor", "barrier", "init_distributed",
            "get_rank", "ReduceOp", "P2POp"} <= names and len(names) > 50, sorted(names)
    missing = sorted(n for n in names if not hasattr(ours, n))
    assert not missing, missing
    assert set(ours.REFUSED) <= names  # nothing refused that DeepSpeed does not have
    for name in sorted(names):
        obj = getattr(ours, name)
        if name in ours.REFUSED:
            with pytest.raises(ConfigError) as e:
                obj()
            line = str(e.value)
            assert line == f"deepspeed.comm.{name} is not in the megatron_2bw drop-in: " \
                           f"{ours.REFUSED[name]}" and "\n" not in line, line
            continue
        assert callable(obj), name
        if name in real["functions"]:  # DeepSpeed's parameters, by name (keyword calls work)
            params = inspect.signature(obj).parameters
            taken = set(params) if not any(p.kind == p.VAR_KEYWORD
                                           for p in params.values()) else None
            assert taken is None or set(real["functions"][name]) <= taken, \
                (name, real["functions"][name], list(params))
    for name, value in real["constants"].items():
        assert getattr(ours, name) == value, name
    assert ours.default_pg_timeout.total_seconds() == real["timeout_s"]


def test_refused_ops_and_groups_are_one_line():
    with pytest.raises(ConfigError, match="op .* is not supported here: use ReduceOp.SUM, AVG, "
                                          "MAX or MIN"):
        ours.all_reduce(torch.zeros(1), op=ours.ReduceOp.PRODUCT)
    with pytest.raises(ConfigError, match=r"recv\(src=None\) \(from any rank\) is not "
                                          "supported: name the sending rank"):
        ours.recv(torch.zeros(1))


def _harness(rank, world, path, outdir):
    """DeepSpeed's DistributedExec: its own init, a flag all-gathered, its teardown."""
    ours.destroy_process_group()          # spawn's group: the harness starts its own
    ours.init_distributed(dist_backend="gloo", init_method=f"file://{path}", rank=rank,
                          world_size=world)
    ours.barrier()
    flag = torch.tensor([float(rank == 1)])
    gathered = torch.zeros(world)
    ours.all_gather_into_tensor(gathered, flag)
    work = ours.all_reduce(flag, op=ours.ReduceOp.SUM, async_op=True)
    work.wait()
    result = {"gathered": gathered.tolist(), "sum": flag.item(), "rank": ours.get_rank(),
              "world": ours.get_world_size(), "local": ours.get_local_rank(),
              "launcher": (ours.get_world_rank_from_launcher(),
                           ours.get_world_size_from_launcher())}
    ours.barrier()                        # _dist_destroy: barrier, then destroy
    ours.destroy_process_group()
    result["after"] = ours.is_initialized()
    torch.save(result, os.path.join(outdir, f"{rank}.pt"))


def test_deepspeeds_test_harness_runs_and_tears_down():
    with tempfile.TemporaryDirectory() as d:
        spawn(_harness, 2, args=(os.path.join(d, "store"), d), timeout_minutes=2)
        res = [torch.load(os.path.join(d, f"{r}.pt")) for r in range(2)]
    for rank, r in enumerate(res):
        assert r["gathered"] == [0.0, 1.0] and r["sum"] == 1.0
        assert (r["rank"], r["world"], r["local"], r["launcher"]) == (rank, 2, rank, (rank, 2))
        assert r["after"] is False
