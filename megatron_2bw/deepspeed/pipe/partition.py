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
min-max contiguous partitioner (`megatron_2bw.models.partition`): the slowest stage is as fast
as possible. Costs come from `layer_costs=[...]` or are measured: each layer is built and timed
(forward + backward) on a sample first-layer input `profile_input`, on every rank, and the
maximum over ranks is used so every rank computes the same partition.
"""
from __future__ import annotations

import re
import statistics
import time

import torch
from torch import nn

from megatron_2bw.config import ConfigError
from megatron_2bw.models.partition import partition_balanced, partition_minmax, partition_uniform

METHODS = ("uniform", "parameters", "type:REGEX", "profile")


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
