"""Opt-in: the name `deepspeed` is the drop-in, in this process, for `from deepspeed.x import y`.

    import megatron_2bw.deepspeed.alias as deepspeed     # the one line a script changes
    from deepspeed.pipe import PipelineModule             # the drop-in's
    from deepspeed.runtime.pipe.schedule import TrainSchedule

`import megatron_2bw as deepspeed` is enough for a script that reaches every DeepSpeed name as an
attribute (`deepspeed.pipe.PipelineModule`, `deepspeed.runtime.utils.set_random_seed(...)`), but
a `from deepspeed.x import y` statement asks Python's import system for a module named
`deepspeed`, which that line does not create (it would find the real DeepSpeed if one is
installed). Importing this module registers itself as `deepspeed` and maps each of the
drop-in's DeepSpeed module names (`names.NAMES`) onto the module that holds it here; another
`deepspeed.*` name is a one-line ModuleNotFoundError. If the real DeepSpeed was already imported
in the process the import is refused in one line (the two cannot share the name).
Attributes of `deepspeed` are the package root's (`initialize`, `pipe`, `__version__`, ...).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

from megatron_2bw.config import ConfigError
from megatron_2bw.deepspeed.names import NAMES

__path__ = []   # a package, so `deepspeed.x` names are looked up (by the finder below)


class _Loader(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        # the import system hands back whatever sys.modules holds under the name afterwards
        sys.modules[module.__name__] = importlib.import_module(self.target)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("deepspeed."):
            return None
        rest = fullname[len("deepspeed."):]
        if rest not in NAMES:
            raise ModuleNotFoundError(
                f"No module named {fullname!r} in the megatron_2bw DeepSpeed drop-in (its "
                f"modules: {', '.join('deepspeed.' + n for n in NAMES)})", name=fullname)
        return importlib.util.spec_from_loader(fullname, _Loader(NAMES[rest]))


def __getattr__(name):
    return getattr(importlib.import_module("megatron_2bw"), name)


def _install() -> None:
    me = sys.modules[__name__]
    present = sys.modules.get("deepspeed")
    if present is not None and present is not me:
        raise ConfigError(f"the real DeepSpeed is already imported in this process "
                          f"({getattr(present, '__file__', present)}): import "
                          "megatron_2bw.deepspeed.alias before anything imports deepspeed, or "
                          "use the real DeepSpeed alone")
    sys.modules["deepspeed"] = me
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


_install()
