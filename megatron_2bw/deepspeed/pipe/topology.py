"""DeepSpeed-style process topologies: named axes laid out row-major (the last axis is fastest).

Same API as `deepspeed.runtime.pipe.topology` (pure arithmetic, no process groups). Our
`ProcessGrid` supports the two layouts DeepSpeed users actually pick:

    axes ['pipe', 'data'] or ['pipe', 'data', 'model']  ->  rank order "tp-dp-pp" (the default)
    axes ['data', 'pipe'] or ['data', 'pipe', 'model']  ->  rank order "tp-pp-dp"
"""
from __future__ import annotations

from collections import namedtuple
from itertools import product

from megatron_2bw.config import ConfigError


class ProcessTopology:
    def __init__(self, axes, dims):
        if len(axes) != len(dims) or len(set(axes)) != len(axes):
            raise ConfigError(f"topology axes {list(axes)} and dims {list(dims)} must be "
                              "distinct names, one dim each")
        if any(int(d) < 1 for d in dims):
            raise ConfigError(f"topology dims must be >= 1, got {list(dims)}")
        self.axes, self.dims = list(axes), [int(d) for d in dims]
        self.ProcessCoord = namedtuple("ProcessCoord", self.axes)
        self.mapping = {}
        for rank, coord in enumerate(product(*[range(d) for d in self.dims])):
            self.mapping[self.ProcessCoord(*coord)] = rank

    def get_rank(self, **coord):
        if len(coord) != len(self.axes):
            raise ValueError("get_rank() does not support slices. Use filter_match())")
        return self.mapping[self.ProcessCoord(**coord)]

    def get_axis_names(self):
        return self.axes

    def get_rank_repr(self, rank, omit_axes=("data", "pipe"), inner_sep="_", outer_sep="-"):
        coord = self.get_coord(rank)
        return outer_sep.join(f"{ax}{inner_sep}{getattr(coord, ax):02d}"
                              for ax in self.axes if ax not in omit_axes)

    def get_dim(self, axis):
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank):
        for coord, r in self.mapping.items():
            if r == rank:
                return coord
        raise ValueError(f"rank {rank} not found in topology")

    def get_axis_comm_lists(self, axis):
        """Lists of ranks that differ only along `axis` (one communicator each)."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for ccoord in product(*[range(self.get_dim(a)) for a in others]):
            fixed = dict(zip(others, ccoord))
            lists.append([self.get_rank(**fixed, **{axis: i}) for i in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **filter_kwargs):
        return [r for c, r in self.mapping.items()
                if all(getattr(c, k) == v for k, v in filter_kwargs.items())]

    def get_axis_list(self, axis, idx):
        return self.filter_match(**{axis: idx})

    def world_size(self):
        n = 1
        for d in self.dims:
            n *= d
        return n

    def __str__(self):
        return str(self.mapping)


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline x data parallelism; data is the fast axis (gradient all-reduces stay local)."""

    def __init__(self, num_pp, num_dp):
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline x data x model (tensor) parallelism, model the fastest axis."""

    def __init__(self, num_pp, num_mp, num_dp):
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])


def grid_layout(topo) -> dict:
    """(tensor, pipeline, data, rank_order) of a DeepSpeed-style topology (ours or DeepSpeed's:
    any object with get_axis_names/get_dim). One-line ConfigError for layouts we cannot run."""
    axes = list(topo.get_axis_names())
    unknown = [a for a in axes if a not in ("pipe", "data", "model")]
    if unknown or "pipe" not in axes:
        raise ConfigError(f"topology axes {axes} are not supported: use 'pipe', 'data' and "
                          "optionally 'model' (e.g. PipeDataParallelTopology)")
    dims = {a: topo.get_dim(a) for a in axes}
    if dims.get("model", 1) > 1:
        raise ConfigError(f"a topology with model (tensor) parallel size {dims['model']} is not "
                          "supported by the DeepSpeed drop-in: use num_mp=1 (megatron_2bw's own "
                          "GPT/BERT support --tensor-model-parallel-size)")
    core = [a for a in axes if a != "model"]
    if "model" in axes and axes[-1] != "model":
        raise ConfigError(f"topology axes {axes}: the 'model' axis must be the last (fastest) one")
    if core in (["pipe"], ["pipe", "data"]):
        order = "tp-dp-pp"
    elif core == ["data", "pipe"]:
        order = "tp-pp-dp"
    else:
        raise ConfigError(f"topology axes {axes} are not supported: use ['pipe', 'data'] or "
                          "['data', 'pipe']")
    return {"tensor": 1, "pipeline": dims["pipe"], "data": dims.get("data", 1),
            "rank_order": order}
