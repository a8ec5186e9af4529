"""`PipelineModule` as a view of the engine's current stage module (DeepSpeed's `engine.module`).

The engine holds one stage module per weight version (2BW: two; `pipeline/weights.py`), and which
one holds the newest weights changes with every step. A DeepSpeed script expects the module it
passed to `initialize` to show the weights training produced (`net.parameters()`,
`net.state_dict()`, `net(x)`). Once attached (`attach_engine`, at engine construction, once), the
module asks the engine which stage module is current on every access and shows that one's layers:
nothing is re-pointed after a batch, nothing is copied.

What follows the engine: `_modules` (so `parameters()`, `named_parameters()`, `state_dict()`,
`children()`, `train()`/`eval()` and `to()`), attribute access to submodules (`net.tied_modules`,
`getattr(net, "3")`) and `forward_funcs` (so `forward`). The view of each stage module is built
once and cached; its names and their order are the module's own, so state_dict keys never change.
"""
from __future__ import annotations

from typing import Callable

from torch import nn


class _Followed:
    """An attribute that is the module's own (stored as `own` in its __dict__) until
    `attach_engine`, and then part `part` of the current stage module's view."""

    def __init__(self, own: str, part: int):
        self.own, self.part = own, part

    def __get__(self, obj, objtype=None):
        if obj is None:
            return self
        if obj.__dict__.get("_current") is None:
            return obj.__dict__[self.own]
        return obj._view()[self.part]

    def __set__(self, obj, value):
        obj.__dict__[self.own] = value


class EngineView:
    """Mixin of PipelineModule (before nn.Module in the bases). Needs `_local_start`,
    `_local_stop` and `_entries` (idx -> ("module",) | ("tied", key) | ("fn",))."""

    def attach_engine(self, mpu, current: Callable[[], nn.Module]) -> None:
        """Show `current()` (the engine's stage module holding the newest weights, asked on every
        access) from now on; `mpu()` returns `mpu`, the engine's grid."""
        self.__dict__["_grid"] = mpu
        self.__dict__["_views"] = {}
        self.__dict__["_current"] = current

    def _view(self) -> tuple[dict, list]:
        """(_modules, forward_funcs) of the current stage module."""
        stage = self.__dict__["_current"]()
        cached = self.__dict__["_views"].get(id(stage))
        if cached is None:
            cached = self.__dict__["_views"][id(stage)] = (stage, *self._build_view(stage))
        return cached[1], cached[2]

    def _build_view(self, stage: nn.Module) -> tuple[dict, list]:
        local = range(self._local_start, self._local_stop)
        wrappers = [stage.layers[str(i)] for i in local]
        tied_layer = {}
        for i, w in zip(local, wrappers):
            entry = self._entries[i]
            if entry[0] == "tied":
                tied_layer.setdefault(entry[1], w.layer)
        own = self.__dict__["_modules"]
        modules = {}
        for name, module in own.items():
            if name == "tied_modules":
                modules[name] = nn.ModuleDict({k: tied_layer[k] for k in module})
            elif name.isdigit() and int(name) in local:
                modules[name] = stage.layers[name].layer
            else:
                modules[name] = module
        return modules, wrappers

    # -- what follows the engine -----------------------------------------------------------------
    _modules = _Followed("_modules", 0)
    forward_funcs = _Followed("_forward_funcs", 1)

    def __getattr__(self, name):
        if self.__dict__.get("_current") is not None:
            modules = self._view()[0]
            if name in modules:
                return modules[name]
        return super().__getattr__(name)
