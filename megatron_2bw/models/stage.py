"""Layer specs and stage modules: a model is a list of `LayerSpec`s; a stage builds a contiguous range.

Every layer is built under its own seed (base seed + layer index), so layer i has the same initial
weights whether it is built in a one-process sequential model or on any pipeline stage. Layers that
share a `tied_key` (GPT's word embedding and output layer) share one parameter when they sit on the
same stage; on different stages each copy is initialized from the key's own seed, so the copies
start bitwise equal, and the engine keeps them equal by summing their gradients.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from megatron_2bw.models.recompute import recompute


@dataclass
class LayerSpec:
    build: Callable[[], nn.Module]
    name: str = "layer"
    tied_key: str | None = None
    tied_attr: str = "weight"                     # dotted path to the tied parameter
    tied_init: Callable[[torch.Tensor], None] | None = None
    recompute: bool = False                       # may be recomputed in backward
    tracker: object = None                        # RNG tracker to restore when recomputing
    random: bool | None = None                    # draws random numbers in training (dropout);
                                                  # None: unknown, so the engine seeds it


def _get_param_owner(module: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    *path, name = dotted.split(".")
    for part in path:
        module = getattr(module, part)
    return module, name


def _key_seed(seed: int, key: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(key.encode())) % (2 ** 63)


class StageModule(nn.Module):
    """Layers [start, end) of a spec list, run in order. Parameter names are global:
    `layers.<global index>.<name>`, identical on every stage and in the sequential model."""

    def __init__(self, specs: list[LayerSpec], start: int, end: int, seed: int = 1234,
                 recompute_method: str | None = None, recompute_num_layers: int = 0):
        super().__init__()
        if not 0 <= start < end <= len(specs):
            raise ValueError(f"bad layer range [{start}, {end}) for {len(specs)} layers")
        self.start, self.end = start, end
        # whether a forward may draw random numbers: the engine seeds each microbatch only then
        self.draws_random = any(spec.random is not False for spec in specs[start:end])
        self._plan = _recompute_plan(specs[start:end], recompute_method, recompute_num_layers)
        self.layers = nn.ModuleDict()
        self.tied: dict[str, nn.Parameter] = {}
        for idx in range(start, end):
            spec = specs[idx]
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed + idx)
                layer = spec.build()
            if spec.tied_key is not None:
                owner, attr = _get_param_owner(layer, spec.tied_attr)
                if spec.tied_key in self.tied:
                    owner._parameters[attr] = self.tied[spec.tied_key]
                else:
                    param = owner._parameters[attr]
                    with torch.no_grad(), torch.random.fork_rng(devices=[]):
                        torch.manual_seed(_key_seed(seed, spec.tied_key))
                        if spec.tied_init is not None:
                            spec.tied_init(param)
                    self.tied[spec.tied_key] = param
            self.layers[str(idx)] = layer

    def forward(self, *inputs):
        x = inputs
        layers = list(self.layers.values())
        for lo, hi, tracker in self._plan:
            if tracker is False:
                x = _run(layers[lo:hi], x)
            else:
                x = recompute(lambda *a, chunk=layers[lo:hi]: _run(chunk, a), tracker,
                              *(x if isinstance(x, tuple) else (x,)))
        return x

    def tied_parameter_names(self) -> dict[str, str]:
        """tied key -> the parameter's name in this stage (its first occurrence)."""
        names = {}
        by_id = {id(p): k for k, p in self.tied.items()}
        for name, p in self.named_parameters():
            if id(p) in by_id:
                names.setdefault(by_id[id(p)], name)
        return names


def _run(layers, x):
    for layer in layers:
        x = layer(*x) if isinstance(x, tuple) else layer(x)
    return x


def _recompute_plan(specs: list[LayerSpec], method: str | None, n: int) -> list[tuple]:
    """[(lo, hi, tracker or False)] chunks of this stage's layers; a tracker (or None) means
    "recompute this chunk". uniform: consecutive recomputable layers in chunks of n;
    block: the first n recomputable layers of the stage, one by one."""
    plan, i, done = [], 0, 0
    while i < len(specs):
        if not (method and n > 0 and specs[i].recompute) or (method == "block" and done >= n):
            plan.append((i, i + 1, False))
            i += 1
            continue
        size = n if method == "uniform" else 1
        j = i
        while j < len(specs) and j - i < size and specs[j].recompute:
            j += 1
        plan.append((i, j, specs[i].tracker))
        done += j - i
        i = j
    return plan
