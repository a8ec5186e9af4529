"""Reading Megatron's pickles (common.pt, model_optim_rng.pt) safely and without Megatron.

Megatron's files hold an `argparse.Namespace` of its arguments and, inside it or beside it,
objects of Megatron's own classes (enums such as AttnBackend, dataclasses such as
OptimizerConfig, the rerun state machine). `torch.load(weights_only=True)` refuses them, and
`weights_only=False` would run whatever a file names. `load` unpickles with an allow-list instead:
containers, tensors and storages, numpy arrays (Megatron's RNG state), dtypes, Namespace; any other
class becomes an `Opaque` record of its module, name, arguments and state, so nothing a file names
is imported or run and megatron-core need not be installed.
"""
from __future__ import annotations

import pickle
import types

import torch

_ALLOWED = {
    ("collections", "OrderedDict"), ("collections", "defaultdict"), ("argparse", "Namespace"),
    ("types", "SimpleNamespace"), ("builtins", "set"), ("builtins", "frozenset"),
    ("builtins", "slice"), ("builtins", "complex"), ("builtins", "range"),
    ("builtins", "bytearray"), ("builtins", "getattr"), ("_codecs", "encode"),
    ("copyreg", "_reconstructor"), ("builtins", "object"), ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"), ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"), ("torch._utils", "_rebuild_tensor"),
    ("torch", "Size"), ("torch._tensor", "_rebuild_from_type_v2"), ("torch", "Tensor"),
    ("torch.nn.parameter", "Parameter"), ("torch", "device"),
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar")}


class Opaque:
    """A Megatron object this project has no class for: `module`, `name`, the arguments it was
    made with and its state, never executed."""
    module = name = ""
    args, kwargs, state = (), {}, None

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state):
        self.state = state

    def __repr__(self) -> str:
        value = self.args[0] if len(self.args) == 1 else self.args or self.state
        return f"{self.module}.{self.name}({value!r})"

    def __eq__(self, other):
        return repr(self) == repr(other)

    def __hash__(self):
        return hash(repr(self))


def _opaque(module: str, name: str) -> type:
    return type(name, (Opaque,), {"module": module, "name": name})


class Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED or (module == "numpy.dtypes" and name.endswith("DType")):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "copyreg" and name == "__newobj__":
            return lambda cls, *args: cls.__new__(cls, *args)
        return _opaque(module, name)


# the pickle_module torch.load takes: `Unpickler` and `load` are what it uses
restricted = types.SimpleNamespace(Unpickler=Unpickler, load=lambda f, **kw: Unpickler(f, **kw)
                                   .load(), __name__="megatron_2bw_restricted_pickle")


def load_megatron_file(path, mmap: bool = False):
    """torch.load of a Megatron file (a path or a file object) onto the CPU through the
    allow-list above."""
    return torch.load(path, map_location="cpu", weights_only=False, pickle_module=restricted,
                      mmap=mmap)
