"""The one owner of "a number is finite where a number is meant", for every front door: the float
flags of every console script, the numbers of a DeepSpeed JSON and the float fields of a Config.

    finite_float("1e-3")          argparse type: the float, or "must be a finite number" for
                                  nan, inf, -inf, 1e999 (argparse names the flag)
    FiniteParser(...)             an ArgumentParser whose `type=float` arguments (its groups' and
                                  subparsers' too) convert through finite_float, so a new float
                                  flag cannot forget it, and whose errors are one line; every
                                  console script's parser is one (config/flags.py's FlagParser
                                  subclasses it), and tests/unit/test_finite_numbers.py scans
                                  them all
    is_finite(x)                  a real number (not a bool), finite
    finite_problem(name, value)   "NAME must be a finite number, got nan" or None (JSON values,
                                  programmatic configs: ds_json/types.py, checks.py)
    nonfinite_fields(cfg)         [(flag, value)] of the Config's float fields that are not finite

Why one owner: NaN compares false with everything, so `value < 0` lets it through
(`--clip-grad nan` passed the >= 0 check and clipping was silently off; `--exit-duration-in-mins
nan` was never reached), and json.loads accepts NaN and Infinity. No torch, no process group.
"""
from __future__ import annotations

import argparse
import dataclasses
import math

NOT_FINITE = "must be a finite number"


def is_finite(value) -> bool:
    """True for an int or float (not a bool) that is neither NaN nor infinite."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def finite_float(text: str) -> float:
    """argparse's type for a float flag: float(text), refused when it is not finite. A
    ValueError for text that is no number at all (argparse: "invalid float value")."""
    value = float(text)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{NOT_FINITE}, got {text!r}")
    return value


class FiniteParser(argparse.ArgumentParser):
    """argparse.ArgumentParser whose `type=float` arguments convert through `finite_float`
    (argparse's type registry, shared with the argument groups; subparsers are made of this
    class too), and whose errors are one line ("PROG: error: ...", exit 2; no usage dump)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.register("type", float, finite_float)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def finite_problem(name: str, value) -> str | None:
    """"NAME must be a finite number, got VALUE" for a number that is NaN or infinite, else None
    (a value that is no number at all is the caller's to word)."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"{name} {NOT_FINITE}, got {value}"
    return None


# Config float fields whose Megatron flag is not --FIELD-NAME
_FLAG_OF = {"model.layernorm_epsilon": "--norm-epsilon",
            "parallel.timeout_minutes": "--distributed-timeout-minutes"}


def nonfinite_fields(cfg) -> list[tuple[str, float]]:
    """(flag, value) of every float field of the Config `cfg` (its sections' dataclasses) that is
    NaN or infinite, in field order."""
    out = []
    for section in dataclasses.fields(cfg):
        sub = getattr(cfg, section.name)
        if not dataclasses.is_dataclass(sub):
            continue
        for f in dataclasses.fields(sub):
            value = getattr(sub, f.name)
            if isinstance(value, float) and not math.isfinite(value):
                path = f"{section.name}.{f.name}"
                out.append((_FLAG_OF.get(path, "--" + f.name.replace("_", "-")), value))
    return out
