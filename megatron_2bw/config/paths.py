"""Directories a run writes into (--save, --tensorboard-dir), checked before any process group."""
from __future__ import annotations

from megatron_2bw.config.choices import ConfigError
from megatron_2bw.fs import writable_problem


def check_writable_dir(path: str, flag: str, error: type[ConfigError] = ConfigError) -> None:
    """Create `path` if needed; a one-line `error` naming `flag` when it is a file, cannot be
    created or is not writable."""
    problem = writable_problem(path)
    if problem == "is a file, not a directory":
        raise error(f"{flag} {path} is a file, not a directory: choose a directory")
    if problem:
        raise error(f"{flag} {path} {problem}: choose a directory you can write")
