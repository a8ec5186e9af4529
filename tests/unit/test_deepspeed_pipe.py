"""DeepSpeed drop-in, no processes: PipelineModule partition methods, topologies and the
DeepSpeed layer call convention."""
import random

import pytest
import torch
from torch import nn

from megatron_2bw.deepspeed.pipe import (LayerSpec, PipeDataParallelTopology,
                                         PipeModelDataParallelTopology, PipelineModule,
                                         ProcessTopology, partition_layers, partition_uniform)
from megatron_2bw.deepspeed.pipe.topology import grid_layout
from megatron_2bw.parallel.grid import ProcessGrid

from test_deepspeed_config import deepspeed_module, one_line_error  # noqa: E402



class Block(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.fc = nn.Linear(n, n)

    def forward(self, x):
        return torch.relu(self.fc(x))


def thirty_layers():
    layers = [LayerSpec(nn.Linear, 8, 16)]
    for i in range(28):
        layers.append(LayerSpec(Block, 16) if i % 3 else (lambda x: x * 1.0))
    layers.append(LayerSpec(nn.Linear, 16, 4))
    return layers


def _placed_once(parts, n, d):
    assert len(parts) == d + 1 and parts[0] == 0 and parts[-1] == n
    assert all(parts[s] < parts[s + 1] for s in range(d)), parts
    owners = [s for s in range(d) for _ in range(parts[s], parts[s + 1])]
    assert len(owners) == n


@pytest.mark.parametrize("method", ["uniform", "parameters", "type:block", "profile"])
@pytest.mark.parametrize("n,d", [(30, 4), (7, 3), (5, 5)])
def test_partition_methods_place_every_layer_once(method, n, d):
    layers = thirty_layers()[:n - 1] + [LayerSpec(nn.Linear, 16, 4)]
    if method == "type:block" and not any(getattr(x, "typename", None) is Block for x in layers):
        layers[1] = LayerSpec(Block, 16)
    kw = {"layer_costs": [random.Random(n).random() for _ in range(n)]} \
        if method == "profile" else {}
    _placed_once(partition_layers(layers, d, method, **kw), n, d)


def test_partitions_match_deepspeed():
    ds_utils = deepspeed_module("deepspeed.runtime.utils")
    from megatron_2bw.deepspeed.pipe.partition import count_layer_params
    layers = thirty_layers()
    counts = count_layer_params(layers)
    assert partition_layers(layers, 4, "parameters") == ds_utils.partition_balanced(counts, 4)
    assert partition_layers(layers, 4, "uniform") == ds_utils.partition_uniform(30, 4)
    for n, d in ((3, 5), (5, 5), (7, 3), (30, 4)):
        assert partition_uniform(n, d) == ds_utils.partition_uniform(n, d)


def test_profile_partition_balances_measured_time():
    layers = thirty_layers()
    # profile: measured forward+backward times on a sample input
    parts = partition_layers(layers, 4, "profile", profile_input=torch.randn(2, 8))
    _placed_once(parts, 30, 4)
    costs = [1.0] * 10 + [5.0] * 10 + [1.0] * 10
    parts = partition_layers(layers, 4, "profile", layer_costs=costs)
    sums = [sum(costs[parts[s]:parts[s + 1]]) for s in range(4)]
    assert max(sums) == 20.0  # the optimal bottleneck
    one_line_error(partition_layers, layers, 4, "profile", match="profile_input")
    one_line_error(partition_layers, layers, 4, "type:Conv2d", match="matches no layer type")
    one_line_error(partition_layers, layers, 4, "best", match="unknown partition_method")


# -- topologies -------------------------------------------------------------------------------------
TOPOLOGIES = [PipeDataParallelTopology(2, 3), ProcessTopology(["data", "pipe"], [3, 2]),
              PipeModelDataParallelTopology(2, 1, 3)]


@pytest.mark.parametrize("topo", TOPOLOGIES)
def test_topologies_map_onto_the_process_grid(topo):
    layout = grid_layout(topo)
    for rank in range(6):
        grid = ProcessGrid(1, layout["pipeline"], layout["data"], rank=rank,
                           rank_order=layout["rank_order"])
        c = topo.get_coord(rank)
        assert (grid.stage, grid.dp_rank) == (c.pipe, c.data)


@pytest.mark.parametrize("topo", TOPOLOGIES)
def test_topologies_match_deepspeed(topo):
    ds_topo = deepspeed_module("deepspeed.runtime.pipe.topology")
    ref = ds_topo.ProcessTopology(topo.axes, topo.dims)
    assert all(ref.get_coord(r) == tuple(topo.get_coord(r)) for r in range(6))
    assert ref.get_axis_comm_lists("data") == topo.get_axis_comm_lists("data")


def test_unsupported_topologies_are_one_line_errors():
    one_line_error(grid_layout, PipeModelDataParallelTopology(2, 2, 1), match="model (tensor)")
    one_line_error(grid_layout, ProcessTopology(["x", "pipe"], [2, 2]), match="not supported")


# -- a one-stage PipelineModule is DeepSpeed's sequential model --------------------------------------
def test_one_stage_module_runs_layers_with_deepspeed_call_convention(monkeypatch):
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    torch.manual_seed(0)
    net = PipelineModule(thirty_layers()[:6] + [LayerSpec(nn.Linear, 16, 4)], num_stages=1,
                         seed_layers=True, partition_method="uniform")
    x = torch.randn(3, 8)
    ref = x
    for idx, spec in enumerate(net._layer_specs):
        if isinstance(spec, LayerSpec):
            torch.manual_seed(1234 + idx)
            ref = spec.build()(ref)
        else:
            ref = spec(ref)
    assert torch.equal(net(x), ref)
    assert net.parts == [0, 7] and net.stage_owner(6) == 0
