"""Placing a DeepSpeed layer list on pipeline stages: `uniform`, `parameters`, `type:REGEX`, `profile`.

Every method returns stage boundaries `[0, b1, ..., len(layers)]`: stage s owns layers
[parts[s], parts[s+1]), so every layer is placed exactly once; an empty stage is a one-line error.

`uniform`, `parameters` and `type:REGEX` reproduce DeepSpeed's arithmetic exactly (same stages for
the same layer list, so a DeepSpeed user's checkpoints and seeds line up): uniform counts, and
DeepSpeed's linear-partition dynamic program (minimize the spread max - min of the stage weights)
over trainable-parameter counts or over 0/1 weights of the layers whose type name matches REGEX.
`parameters` builds every LayerSpec once to count its parameters, as DeepSpeed does (this also
consumes the global RNG the way DeepSpeed does, which keeps `seed_layers=False` initializations
identical to a DeepSpeed run of the same script).

`profile`, which DeepSpeed leaves unimplemented, balances measured costs with the planner's
min-max contiguous partitioner (`megatron_2bw.planner.partition`): the slowest stage is as fast
as possible. Costs come from `layer_costs=[...]` or are measured: each layer is built and timed
(forward + backward) on a sample first-layer input `profile_input`, on every rank, and the
maximum over ranks is used so every rank computes the same partition.
"""
from __future__ import annotations

import re
import statistics
import time

import numpy as np
import torch
from torch import nn

from ..config import ConfigError
from ..pipeline.module import split_evenly

METHODS = ("uniform", "parameters", "type:REGEX", "profile")


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """DeepSpeed's uniform split: the engine's `split_evenly` (the first `num_items % num_parts`
    parts get one more item), and with fewer items than parts one item each, then empty parts."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    return split_evenly(num_items, num_parts)


def partition_balanced(weights, num_parts: int) -> list[int]:
    """DeepSpeed's linear partition (same result): the contiguous split into `num_parts` non-empty
    parts minimizing max(stage sum) - min(stage sum); ties go to the largest split point."""
    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    inf = np.inf
    dp_max = np.full((n + 1, m + 1), inf)
    dp_min = np.full((n + 1, m + 1), inf)
    dp_cost = np.full((n + 1, m + 1), inf)
    position = np.zeros((n + 1, m + 1), dtype=int)
    prefix = np.zeros(n + 1)
    prefix[1:] = np.cumsum(np.asarray(weights, dtype=float))
    dp_max[0, 0] = 0
    dp_cost[0, 0] = 0
    for i in range(1, n + 1):
        seg = prefix[i] - prefix[:i]                       # sum of items k..i-1 for every k < i
        for j in range(1, min(i, m) + 1):
            max_sum = np.maximum(dp_max[:i, j - 1], seg)
            min_sum = np.minimum(dp_min[:i, j - 1], seg)
            cost = max_sum - min_sum
            best = cost.min()
            k = int(np.flatnonzero(cost == best)[-1]) if np.isfinite(best) else i - 1
            dp_cost[i, j], dp_max[i, j], dp_min[i, j] = cost[k], max_sum[k], min_sum[k]
            position[i, j] = k
    parts = [n]
    for j in reversed(range(1, m + 1)):
        parts.append(int(position[parts[-1], j]))
    return parts[::-1]


def partition_minmax(costs, num_parts: int) -> list[int]:
    """Contiguous partition minimizing the largest stage cost (the planner's partitioner)."""
    from ..planner.partition import partition
    return [int(b) for b in partition([float(c) for c in costs], num_parts)]


# -- what a layer entry is ------------------------------------------------------------------------
def is_spec(layer) -> bool:
    """A LayerSpec: ours or DeepSpeed's (duck-typed so deepspeed need not be installed)."""
    return hasattr(layer, "typename") and hasattr(layer, "module_args") and hasattr(layer, "build")


def is_tied_spec(layer) -> bool:
    return is_spec(layer) and hasattr(layer, "key") and hasattr(layer, "tied_weight_attr")


def layer_name(layer) -> str | None:
    """DeepSpeed's name for type matching: the spec's class, the module's class, a callable's
    __name__ (None if it has none)."""
    if is_spec(layer):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return layer.__class__.__name__
    return getattr(layer, "__name__", None)


def count_layer_params(layers) -> list[int]:
    """Trainable parameters per layer; LayerSpecs are built (and dropped) one at a time."""
    counts = []
    for layer in layers:
        module = layer.build() if is_spec(layer) else layer
        if isinstance(module, nn.Module):
            counts.append(sum(p.numel() for p in module.parameters() if p.requires_grad))
        else:
            counts.append(0)
    return counts


def find_layer_type(layers, regex: str) -> list[int]:
    pattern = re.compile(regex, re.IGNORECASE)
    idxs = [i for i, layer in enumerate(layers)
            if (name := layer_name(layer)) is not None and pattern.search(name)]
    if not idxs:
        raise ConfigError(f"partition_method 'type:{regex}' matches no layer type: the layer "
                          f"types are {sorted({layer_name(x) for x in layers} - {None})}")
    return idxs


def profile_layer_costs(layers, sample_input, repeats: int = 3) -> list[float]:
    """Forward + backward seconds of each layer, run in sequence on `sample_input` (the input of
    the first layer). The global RNG is left untouched."""
    costs = []
    with torch.random.fork_rng(devices=[]):
        x = sample_input
        for layer in layers:
            module = layer.build() if is_spec(layer) else layer
            times = []
            for _ in range(repeats):
                inp = _detach(x)
                t0 = time.perf_counter()
                out = module(inp)
                floats = [t for t in _tensors(out) if t.requires_grad]
                if floats:
                    torch.autograd.backward([t.float().sum() for t in floats])
                times.append(time.perf_counter() - t0)
            costs.append(statistics.median(times))
            if isinstance(module, nn.Module):
                module.zero_grad(set_to_none=True)
            x = _detach(out)
    return costs


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    return []


def _detach(obj):
    if isinstance(obj, torch.Tensor):
        out = obj.detach()
        return out.requires_grad_(True) if out.is_floating_point() else out
    if isinstance(obj, (tuple, list)):
        return type(obj)(_detach(o) for o in obj)
    return obj


def partition_layers(layers, num_stages: int, method: str = "parameters", layer_costs=None,
                     profile_input=None, agree=None) -> list[int]:
    """Stage boundaries of `layers` under `method`. `agree(costs) -> costs` makes measured costs
    identical on every rank (the PipelineModule passes an all-reduce max)."""
    n = len(layers)
    if num_stages > n:
        raise ConfigError(f"cannot place {n} layers on {num_stages} pipeline stages: every stage "
                          "needs at least one layer (fewer stages or more layers)")
    key = method.lower()
    if key == "uniform":
        parts = partition_uniform(n, num_stages)
    elif key == "parameters":
        parts = partition_balanced(count_layer_params(layers), num_stages)
    elif key.startswith("type:"):
        weights = [0] * n
        for i in find_layer_type(layers, method.split(":", 1)[1]):
            weights[i] = 1
        parts = partition_balanced(weights, num_stages)
    elif key == "profile":
        if layer_costs is not None:
            costs = [float(c) for c in layer_costs]
            if len(costs) != n or any(not c >= 0 for c in costs):
                raise ConfigError(f"layer_costs must hold one cost >= 0 per layer ({n}), got "
                                  f"{len(costs)} values")
        elif profile_input is not None:
            costs = profile_layer_costs(layers, profile_input)
            if agree is not None:
                costs = agree(costs)
        else:
            raise ConfigError("partition_method 'profile' needs layer_costs=[one cost per layer] "
                              "or profile_input=<a sample input of the first layer> to time them")
        parts = partition_minmax(costs, num_stages)
    else:
        raise ConfigError(f"unknown partition_method {method!r}: use one of {', '.join(METHODS)}")
    if any(parts[s] >= parts[s + 1] for s in range(num_stages)) or parts[0] != 0 \
            or parts[-1] != n:
        raise ConfigError(f"partition_method {method!r} left a pipeline stage empty ({parts}): "
                          "use fewer stages or partition_method='uniform'")
    return parts
