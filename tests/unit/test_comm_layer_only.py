"""Every collective and point-to-point call of the package goes through megatron_2bw/parallel/
(issue 13): no other module of the package, the tools, the benches, the examples or the entry
points calls a torch.distributed collective, p2p or group/set-up function directly. tests/ may."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMM_LAYER = ROOT / "megatron_2bw" / "parallel"
MODULES = ("torch.distributed", "torch.distributed.distributed_c10d")
SCANNED = [ROOT / "megatron_2bw", ROOT / "tools", ROOT / "bench", ROOT / "examples",
           *ROOT.glob("pretrain_*.py")]
FORBIDDEN = {
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor",
    "all_gather_object", "all_gather_coalesced", "broadcast", "broadcast_object_list", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list", "gather",
    "gather_object", "all_to_all", "all_to_all_single", "barrier", "monitored_barrier", "send",
    "recv", "isend", "irecv", "send_object_list", "recv_object_list", "batch_isend_irecv",
    "P2POp", "new_group", "new_subgroups", "new_subgroups_by_enumeration", "split_group",
    "init_process_group", "destroy_process_group", "ReduceOp",
}


def direct_calls(source: str) -> list[str]:
    """'line: name' of every use of a FORBIDDEN torch.distributed name in `source`: through an
    alias of the module (import torch.distributed as dist; from torch import distributed), the
    full dotted path, or a from-import of the name itself."""
    tree = ast.parse(source)
    aliases, hits = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in MODULES and a.asname:
                    aliases.add(a.asname)
        elif isinstance(node, ast.ImportFrom):
            if node.module == "torch":
                aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
            elif node.module in MODULES:
                hits += [f"{node.lineno}: from {node.module} import {a.name}"
                         for a in node.names if a.name in FORBIDDEN]
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr in FORBIDDEN):
            continue
        owner = ast.unparse(node.value)
        if owner in aliases or owner in MODULES:
            hits.append(f"{node.lineno}: {owner}.{node.attr}")
    return hits


def _python_files():
    for base in SCANNED:
        files = [base] if base.is_file() else sorted(base.rglob("*.py"))
        for path in files:
            if COMM_LAYER not in path.parents:
                yield path


def test_no_direct_collective_outside_the_comm_layer():
    offenders = {}
    for path in _python_files():
        hits = direct_calls(path.read_text())
        if hits:
            offenders[str(path.relative_to(ROOT))] = hits
    assert not offenders, ("call torch.distributed only in megatron_2bw/parallel/ (a Comm "
                           f"method): {offenders}")


def test_the_scan_covers_the_callers():
    names = {str(p.relative_to(ROOT)) for p in _python_files()}
    for expected in ("megatron_2bw/training/reliability.py", "megatron_2bw/training/loop.py",
                     "megatron_2bw/deepspeed/pipe/module.py", "megatron_2bw/deepspeed/engine.py",
                     "megatron_2bw/pipeline/batch_step.py", "bench/plan_accuracy.py",
                     "pretrain_gpt.py", "tools/plan.py"):
        assert expected in names
    assert not any(n.startswith("megatron_2bw/parallel/") for n in names)


@pytest.mark.parametrize("source", [
    "import torch.distributed as dist\ndist.all_reduce(t)",
    "import torch\ntorch.distributed.all_reduce(torch.tensor([1.0]))",
    "from torch import distributed as d\nd.barrier()",
    "from torch import distributed\ndistributed.batch_isend_irecv(ops)",
    "from torch.distributed import all_gather_object",
    "import torch.distributed as dist\nop = dist.ReduceOp.MAX",
    "import torch.distributed as dist\ng = dist.new_group([0, 1])",
])
def test_the_scan_catches_a_direct_call(source):
    assert direct_calls(source), source


@pytest.mark.parametrize("source", [
    "from torch.distributed import pipelining as P",   # a peer implementation in bench/
    "import torch.distributed\n",
    "comm.all_reduce(t, group)",
    "grid.comm.barrier()",
])
def test_the_scan_allows_the_comm_layer_and_peers(source):
    assert direct_calls(source) == []
