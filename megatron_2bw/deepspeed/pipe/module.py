"""DeepSpeed's `PipelineModule`, `LayerSpec` and `TiedLayerSpec`, run by the 2BW engine.

A model is a list of layers: `LayerSpec`s (built only on the stage that owns them), `TiedLayerSpec`s
(one module per key and stage; the tied weight's gradient is summed across stages), plain
`nn.Module`s and plain callables. Each layer is called with ONE argument, like DeepSpeed: the
previous layer's output, a tuple staying a tuple.

Construction follows DeepSpeed step by step, so a script seeded the same way gets the same initial
weights under either package: partition (`parameters` builds every LayerSpec once to count its
parameters), then build this stage's layers in order (`seed_layers=True` reseeds random, numpy and
torch with base_seed + layer index before each). The copies of a tied weight start equal because
`deepspeed_api.initialize` broadcasts them from the first stage (DeepSpeed does it here, in the
constructor; we wait so that a bad configuration fails before any process group work).

Engine mapping: each local layer is wrapped in `_DSLayer` (one-argument call convention) and becomes
an engine `LayerSpec` whose build returns the already-built wrapper; a key tied across stages
becomes the engine's `tied_key` (the engine all-reduces it between the first and last stage,
which is therefore where such keys must live). Once the engine is built, the module is a view of
the engine's stage module holding the newest weights (`engine_view.py`).
"""
from __future__ import annotations

import torch
from torch import nn

from megatron_2bw.config import ConfigError
from megatron_2bw.deepspeed.pipe.engine_view import EngineView
from megatron_2bw.deepspeed.pipe.partition import (is_spec, is_tied_spec, layer_name,
                                                   partition_layers)
from megatron_2bw.deepspeed.pipe.topology import (PipeDataParallelTopology, ProcessTopology,
                                                  grid_layout)
from megatron_2bw.deepspeed.runtime.utils import set_random_seed
from megatron_2bw.models.stage import LayerSpec as EngineLayerSpec
from megatron_2bw.parallel.comm import Comm
from megatron_2bw.parallel.devices import is_initialized
from megatron_2bw.parallel.distributed import current_rank_world


class PipelineError(Exception):
    """Errors related to the use of PipelineModule (DeepSpeed's name)."""


class LayerSpec:
    """Type and arguments of a layer, built lazily on the stage that owns it."""

    def __init__(self, typename, *module_args, **module_kwargs):
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec only supports torch.nn.Module types, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs
        self.global_rank = current_rank_world()[0] if is_initialized() else -1

    def __repr__(self):
        args = [repr(a) for a in self.module_args]
        args += [f"{k}={v!r}" for k, v in self.module_kwargs.items()]
        return f"{self.typename.__name__}({', '.join(args)})"

    def build(self, log=False):
        if log:
            print(f"RANK={self.global_rank} building {self!r}")
        return self.typename(*self.module_args, **self.module_kwargs)


class TiedLayerSpec(LayerSpec):
    """A layer whose `tied_weight_attr` parameters are shared by every layer with the same key."""

    def __init__(self, key, typename, *module_args, forward_fn=None, tied_weight_attr=("weight",),
                 **module_kwargs):
        super().__init__(typename, *module_args, **module_kwargs)
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) \
            else list(tied_weight_attr)


class _DSLayer(nn.Module):
    """One layer with DeepSpeed's call convention: a single argument (a tuple stays a tuple).
    `layer` is the module (None for plain callables); `fn(layer, x)` or `fn(x)` when given."""

    def __init__(self, layer: nn.Module | None = None, fn=None):
        super().__init__()
        self.layer = layer
        self.fn = fn

    def forward(self, *args):
        x = args[0] if len(args) == 1 else args
        if self.fn is None:
            return self.layer(x)
        return self.fn(x) if self.layer is None else self.fn(self.layer, x)


def resolve_process_topology(num_stages, topology, world_size: int):
    """Our ProcessTopology (DeepSpeed's rank grid) for a PipelineModule's (num_stages, topology)
    in a world; one-line ConfigErrors. (The planner's `resolve_topology` is the hardware.)"""
    if topology is None:
        if num_stages is None:
            raise ConfigError("PipelineModule needs num_stages or topology")
        if int(num_stages) < 1:
            raise ConfigError(f"num_stages must be >= 1, got {num_stages}")
        if world_size % int(num_stages) != 0:
            raise ConfigError(f"num_stages ({num_stages}) must divide the world size "
                              f"({world_size}): launch a multiple of {num_stages} processes or "
                              "change num_stages")
        return PipeDataParallelTopology(int(num_stages), world_size // int(num_stages))
    if not isinstance(topology, ProcessTopology):  # DeepSpeed's own topology object
        topology = ProcessTopology(list(topology.get_axis_names()),
                                   [topology.get_dim(a) for a in topology.get_axis_names()])
    grid_layout(topology)
    if num_stages is not None and int(num_stages) != topology.get_dim("pipe"):
        raise ConfigError(f"num_stages ({num_stages}) differs from the topology's pipe size "
                          f"({topology.get_dim('pipe')}): pass one of them")
    if topology.world_size() != world_size:
        raise ConfigError(f"the topology has {topology.world_size()} ranks but the world size is "
                          f"{world_size}: launch {topology.world_size()} processes")
    return topology


class PipelineModule(EngineView, nn.Module):
    """DeepSpeed's PipelineModule (same arguments). Extra keyword-only arguments for
    partition_method='profile': `layer_costs` (one cost per layer) or `profile_input` (a sample
    first-layer input whose per-layer forward+backward time is measured)."""

    def __init__(self, layers, num_stages=None, topology=None, loss_fn=None, seed_layers=False,
                 seed_fn=None, base_seed=1234, partition_method="parameters",
                 activation_checkpoint_interval=0, activation_checkpoint_func=None,
                 checkpointable_layers=None, dynamic_shape=False, *, layer_costs=None,
                 profile_input=None):
        super().__init__()
        if checkpointable_layers is not None and not isinstance(checkpointable_layers, list):
            raise ConfigError("checkpointable_layers must be a list of layer class names")
        rank, world = current_rank_world()
        topo = resolve_process_topology(num_stages, topology, world)
        specs = list(layers)
        parts = partition_layers(specs, topo.get_dim("pipe"), partition_method,
                                 layer_costs=layer_costs, profile_input=profile_input,
                                 agree=_max_over_ranks)
        self._setup(specs, topo, rank, world, parts, loss_fn, seed_layers, seed_fn, base_seed,
                    partition_method, activation_checkpoint_interval, activation_checkpoint_func,
                    checkpointable_layers, dynamic_shape)
        self._check_ties()
        # build this stage's layers exactly as DeepSpeed does (same order, same RNG consumption)
        for idx in range(self._local_start, self._local_stop):
            layer = specs[idx]
            if seed_layers:
                (seed_fn or set_random_seed)(base_seed + idx)
            if isinstance(layer, PipelineModule) or _is_ds_pipeline_module(layer):
                raise NotImplementedError("RECURSIVE BUILD NOT YET IMPLEMENTED")
            if isinstance(layer, nn.Module):
                self._add_local(idx, module=layer)
            elif is_tied_spec(layer):
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = layer.build()
                    self.tied_weight_attrs[layer.key] = list(layer.tied_weight_attr)
                self._add_local(idx, tied=layer.key, fn=layer.forward_fn)
            elif is_spec(layer):
                self._add_local(idx, module=layer.build())
            elif callable(layer):
                self._add_local(idx, fn=layer)
            else:
                raise ConfigError(f"layer {idx} ({layer!r}) is not a LayerSpec, module or callable")
        for p in self.parameters():
            p.ds_pipe_replicated = False

    # -- construction helpers ---------------------------------------------------------------------
    def _setup(self, specs, topo, rank, world, parts, loss_fn, seed_layers, seed_fn, base_seed,
               partition_method, interval, ckpt_func, checkpointable_layers, dynamic_shape):
        self._layer_specs = specs
        self._num_layers = len(specs)
        self._topo = topo
        self.global_rank, self.world_size = rank, world
        self.num_stages = topo.get_dim("pipe")
        self.stage_id = topo.get_coord(rank).pipe
        self.parts = list(parts)
        self._local_start, self._local_stop = parts[self.stage_id], parts[self.stage_id + 1]
        self.loss_fn = loss_fn
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.partition_method = partition_method
        self.activation_checkpoint_interval = int(interval or 0)
        self.activation_checkpoint_func = ckpt_func
        self.checkpointable_layers = checkpointable_layers
        self.dynamic_shape = dynamic_shape
        self.micro_offset = 0
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self.forward_funcs: list[_DSLayer] = []
        self.fwd_map: dict[str, int] = {}
        self._entries: dict[int, tuple] = {}      # idx -> ("module"|"tied"|"fn", ...)
        self._grid = None

    def _add_local(self, idx, module=None, tied=None, fn=None):
        if module is not None:
            self.add_module(str(idx), module)
            self.fwd_map[str(idx)] = len(self.forward_funcs)
            self._entries[idx] = ("module",)
            wrapper = _DSLayer(module)
        elif tied is not None:
            self._entries[idx] = ("tied", tied)
            wrapper = _DSLayer(self.tied_modules[tied], fn)
        else:
            self._entries[idx] = ("fn",)
            wrapper = _DSLayer(None, fn)
        self.forward_funcs.append(wrapper)

    @classmethod
    def from_deepspeed(cls, ds_module) -> "PipelineModule":
        """Adopt a real `deepspeed.pipe.PipelineModule`: its specs, partition, topology, loss and
        the layers it already built (weights are kept as they are)."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        topo = resolve_process_topology(None, ds_module._topo, ds_module.world_size)
        self._setup(list(ds_module._layer_specs), topo, ds_module.global_rank,
                    ds_module.world_size, ds_module.parts, ds_module.loss_fn,
                    ds_module.seed_layers, ds_module.seed_fn, ds_module.base_seed, "deepspeed",
                    ds_module.activation_checkpoint_interval, None,
                    ds_module.checkpointable_layers, getattr(ds_module, "dynamic_shape", False))
        self._check_ties()
        for key, mod in ds_module.tied_modules.items():
            self.tied_modules[key] = mod
            self.tied_weight_attrs[key] = list(ds_module.tied_weight_attrs[key])
        for local, func in enumerate(ds_module.forward_funcs):
            idx = self._local_start + local
            spec = self._layer_specs[idx]
            if is_tied_spec(spec):
                self._add_local(idx, tied=spec.key, fn=spec.forward_fn)
            elif isinstance(func, nn.Module):
                self._add_local(idx, module=func)
            else:
                self._add_local(idx, fn=func)
        return self

    def _check_ties(self):
        """Keys tied across stages must sit on the first and last stage (the engine's tied group),
        tie one attribute, and appear in the same order on both stages."""
        self._tie_layers: dict[str, list[int]] = {}
        for idx, spec in enumerate(self._layer_specs):
            if is_tied_spec(spec):
                self._tie_layers.setdefault(spec.key, []).append(idx)
        self._cross_keys = []
        last = self.num_stages - 1
        for key, idxs in self._tie_layers.items():
            stages = sorted({self.stage_owner(i) for i in idxs})
            if len(stages) == 1:
                continue
            if stages != [0, last]:
                raise ConfigError(f"tied layer key {key!r} sits on stages {stages}: the 2BW engine "
                                  "ties weights between the first and last stage only")
            attrs = self._layer_specs[idxs[0]].tied_weight_attr
            if len(attrs) != 1:
                raise ConfigError(f"tied layer key {key!r} ties {len(attrs)} attributes across "
                                  "stages: tie exactly one (tied_weight_attr='name')")
            self._cross_keys.append(key)

        def order(stage):
            lo, hi = self.parts[stage], self.parts[stage + 1]
            return sorted(self._cross_keys, key=lambda k: min(i for i in self._tie_layers[k]
                                                                if lo <= i < hi))
        if len(self._cross_keys) > 1 and order(0) != order(last):
            raise ConfigError(f"tied keys {order(0)} appear in a different order on the last "
                              f"stage ({order(last)}): list them in the same order")

    # -- DeepSpeed API ------------------------------------------------------------------------------
    def forward(self, forward_input):
        """Run this stage's layers (DeepSpeed semantics; the engine drives training itself)."""
        self.micro_offset += 1
        x = forward_input
        for layer in self.forward_funcs:
            x = layer(x)
        return x

    def partitions(self):
        return self.parts

    def stage_owner(self, layer_idx):
        if not 0 <= layer_idx < self._num_layers:
            raise ValueError(f"layer {layer_idx} out of range")
        for stage in range(self.num_stages):
            if self.parts[stage] <= layer_idx < self.parts[stage + 1]:
                return stage
        raise RuntimeError(f"Layer {layer_idx} not owned? parts={self.parts}")

    def topology(self):
        return self._topo

    def mpu(self):
        return self._grid

    def num_pipeline_stages(self):
        return self.num_stages

    def set_checkpoint_interval(self, interval):
        if interval < 0:
            raise ValueError("interval must be >= 0")
        self.activation_checkpoint_interval = interval

    def get_additional_losses(self):
        return None

    def ckpt_layer_name(self, idx: int) -> str:
        """DeepSpeed's per-layer checkpoint file name (data and pipe axes omitted)."""
        rank_repr = self._topo.get_rank_repr(rank=self.global_rank)
        return f"layer_{idx:02d}" + (f"-{rank_repr}" if rank_repr else "") + "-model_states.pt"

    # -- engine glue ------------------------------------------------------------------------------
    def layer_type_name(self, idx: int) -> str:
        return layer_name(self._layer_specs[idx]) or f"layer{idx}"

    def local_layer_module(self, idx: int):
        """The module holding layer idx's parameters (None for a plain callable)."""
        return self.forward_funcs[idx - self._local_start].layer

    def engine_specs(self) -> list[EngineLayerSpec]:
        """Engine LayerSpecs for the whole layer list; local ones return the built wrappers."""
        specs = []
        interval = self.activation_checkpoint_interval
        for idx in range(self._num_layers):
            local = self._local_start <= idx < self._local_stop
            entry = self._entries.get(idx) if local else None
            wrapper = self.forward_funcs[idx - self._local_start] if local else None
            tied_key = tied_attr = None
            if entry is not None and entry[0] == "tied" and entry[1] in self._cross_keys:
                tied_key = entry[1]
                tied_attr = "layer." + self._param_path(tied_key)
            specs.append(EngineLayerSpec(
                build=(lambda w=wrapper: w) if local else _not_local(idx),
                name=self.layer_type_name(idx), tied_key=tied_key,
                tied_attr=tied_attr or "weight",
                recompute=bool(interval) and local and self._checkpointable(idx, wrapper)))
        return specs

    def _param_path(self, key: str) -> str:
        """The dotted parameter name of a tied key's attribute, which may be a property (as
        Megatron-DeepSpeed's `word_embeddings_weight`): DeepSpeed reads it with getattr."""
        module, attr = self.tied_modules[key], self.tied_weight_attrs[key][0]
        target = module
        for part in attr.split("."):
            target = getattr(target, part)
        return next((n for n, p in module.named_parameters() if p is target), attr)

    def _checkpointable(self, idx, wrapper) -> bool:
        if idx == 0:
            return False  # the model's inputs need no grad: a recomputed first chunk would lose it
        if self.checkpointable_layers is not None:
            return self.layer_type_name(idx) in self.checkpointable_layers
        return wrapper.layer is not None and any(True for _ in wrapper.layer.parameters())

    def tied_sync_params(self) -> list[tuple[str, nn.Parameter]]:
        """(key, parameter) of every key tied across stages that this stage holds, in key order."""
        out = []
        for key in sorted(self._cross_keys):
            if key in self.tied_modules:
                owner = self.tied_modules[key]
                for part in self.tied_weight_attrs[key][0].split("."):
                    owner = getattr(owner, part)
                out.append((key, owner))
        return out


def _not_local(idx):
    def build():
        raise RuntimeError(f"layer {idx} is not built on this stage")
    return build


def _is_ds_pipeline_module(obj) -> bool:
    return type(obj).__name__ == "PipelineModule" and hasattr(obj, "_layer_specs") \
        and not isinstance(obj, PipelineModule)


def _max_over_ranks(costs: list[float]) -> list[float]:
    """Measured costs agreed by every rank (profile partitioning). Through a Comm of the process
    group, whose device comes from the launcher's local rank (NCCL: this rank's GPU, not
    whatever device is current before the engine sets it); no process group: the costs."""
    return Comm().reduce_floats(costs, op="max")
