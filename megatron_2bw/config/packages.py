"""The loggers' packages a setting needs, checked before any process group.

wandb (--wandb-project, DeepSpeed's "wandb" monitor) is imported here, not only looked up: an
installed wandb that fails to import (a protobuf or pydantic it was not built for, a half-written
install) would otherwise stop the job at its first log line, after every rank had started. The
import runs only where wandb is asked for. tensorboard is looked up where it is needed
(training/observe/writers.py, config/ds_json/monitors.py): torch imports it only to write.
"""
from __future__ import annotations

import importlib


def wandb_problem(needed_by: str = "--wandb-project", instead: str | None = None,
                  import_module=importlib.import_module) -> str | None:
    """One line saying why wandb cannot be used by `needed_by` (missing, or failing to
    import) and what to do (`instead`: the other way out, default "drop `needed_by`"), or None
    when it imports."""
    instead = instead or f"drop {needed_by}"
    try:
        import_module("wandb")
    except ModuleNotFoundError as e:
        if e.name == "wandb":
            return (f"{needed_by} needs the wandb package, which is not installed: pip install "
                    f"wandb (megatron_2bw's install brings it), or {instead}")
        return _broken(needed_by, instead, e)
    except Exception as e:  # noqa: BLE001 - any failure of the import is a broken install
        return _broken(needed_by, instead, e)
    return None


def _broken(needed_by: str, instead: str, e: BaseException) -> str:
    first = str(e).splitlines()[0] if str(e) else ""
    return (f"{needed_by} needs the wandb package, which is installed but fails to import "
            f"({type(e).__name__}: {first}): pip install --force-reinstall wandb, or {instead}")
