"""Directories a run writes into (--save, --tensorboard-dir, --trace, --profile, wandb), checked
before any process group and any iteration."""
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


def output_dirs(train) -> list[tuple[str, str]]:
    """(directory, the flag that names it) of every directory a run of `train` (TrainConfig)
    writes into: checkpoints, TensorBoard events, the profiler's traces, wandb's files and the
    --trace files."""
    import os
    out = []
    if train.save:
        out.append((train.save, "--save"))
    if train.tensorboard_dir:
        out.append((train.tensorboard_dir, "--tensorboard-dir"))
    if train.profile:  # training/observe/profiling.py writes {tensorboard-dir or save or .}/profile
        base = train.tensorboard_dir or train.save or "."
        out.append((os.path.join(base, "profile"), "--profile (its traces)"))
    if train.wandb_project:
        out.append((train.wandb_save_dir or os.path.join(train.save or ".", "wandb"),
                    "--wandb-save-dir" if train.wandb_save_dir else "--wandb-project (its files)"))
    if train.trace:
        out.append((os.path.dirname(os.path.abspath(train.trace)), "--trace (its directory)"))
    return out


def check_output_paths(train, error: type[ConfigError] = ConfigError) -> None:
    """A one-line `error` for the first directory of `output_dirs` that cannot be written
    (created when missing), before any process group and any iteration."""
    for path, flag in output_dirs(train):
        check_writable_dir(path, flag, error)
