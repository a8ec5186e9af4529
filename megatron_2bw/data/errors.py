"""The one error type of the data package: a bad file or data flag, reported in one line.

It subclasses ConfigError (itself a ValueError) so the scripts' `exit_on_config_error` prints it
as one line and exits 2, like any other bad setting.
"""
from __future__ import annotations

from megatron_2bw.config import ConfigError


class DataError(ConfigError):
    """A missing or malformed data/tokenizer file, or a bad data flag. The message is one line
    that names the file (or flag) and says how to fix it."""
