"""Directories a run writes into (--save, --tensorboard-dir), checked before any process group."""
from __future__ import annotations

import os

from .config import ConfigError


def check_writable_dir(path: str, flag: str, error: type[ConfigError] = ConfigError) -> None:
    """Create `path` if needed; a one-line `error` naming `flag` when it is a file, cannot be
    created or is not writable."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise error(f"{flag} {path} is a file, not a directory: choose a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise error(f"{flag} {path} cannot be created ({e.strerror}): choose a directory you "
                    "can write") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise error(f"{flag} {path} is not writable: choose a directory you can write")
