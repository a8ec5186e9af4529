"""The unit every DeepSpeed section is read into: a `Setting` (JSON key, Megatron flag, Config
path, value), and `fail`, the one-line ConfigError every bad key raises."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_2bw.config import ConfigError


def fail(msg: str):
    raise ConfigError(msg)


# -- settings: (json key, megatron flag, config path, value, given explicitly in the JSON) ---------
@dataclass
class Setting:
    key: str
    flag: str | None
    path: str
    value: object
    explicit: bool = True     # the JSON states it (else: a DeepSpeed default the JSON implies)
    absent: bool = False      # DeepSpeed's default for a key the JSON leaves out: the merge with
                              # Megatron flags ignores it (flags and their defaults stand)
