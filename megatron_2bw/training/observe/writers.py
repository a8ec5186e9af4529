"""Where the logged numbers go besides the console: wandb and TensorBoard, the same scalars.

`scalars(metrics)` is the one mapping from a log line's own fields (not Megatron's: those come
as tags, below) to scalar names, for both: spaces become underscores ("memory GB per stage" ->
"memory_GB_per_stage/stage0", ...), a per-stage list becomes one scalar per stage, text (the
ETA, the compensation) is left out. The step is the iteration. Both writers run on the reporting
rank (last stage, first data and tensor rank), need no network (wandb is offline unless
WANDB_MODE says otherwise) and can be on together.

Megatron's tags (`lm loss`, `learning-rate`, `grad-norm`, `loss-scale`, `batch-size`,
`iteration-time`, `lm loss validation`, `lm loss validation ppl`, ...) come as rows (iteration,
samples, {tag: value}) through `write_rows`: TensorBoard writes each at the iteration and again as
`<tag> vs samples` at the consumed samples (Megatron's two series); wandb logs them at the
iteration with Megatron's `samples vs steps` (the consumed samples) beside them.

- wandb (`--wandb-project`, Megatron's flags: `--wandb-exp-name` the run's name,
  `--wandb-entity` the team or user it belongs to, `--wandb-save-dir` where its files go, by
  default {save}/wandb; DeepSpeed's "wandb" section adds its `group`): a run in the mode
  WANDB_MODE says (offline when it is unset). Its step is the iteration: wandb drops (with a
  warning) a point logged to a step before the last one, so callers write in step order (the
  training loop does: interval_log.py; DeepSpeed's monitor events come at global samples).
- TensorBoard (`--tensorboard-dir DIR`): event files written by
  `torch.utils.tensorboard.SummaryWriter` (the tensorboard package, imported only when asked for).
  Flushed at every log interval, so a run that stops on an error keeps every interval it logged.

`check_loggers` refuses, in one message before any process group, what would fail later: a
--tensorboard-dir without the tensorboard package, a --wandb-project without an importable wandb
(missing, or installed but failing to import: config/packages.py); each writer checks again if a
caller of `training.train` skipped it.
"""
from __future__ import annotations

import importlib.util
import os

from megatron_2bw.config import ConfigError
from megatron_2bw.config.packages import wandb_problem
from megatron_2bw.config.paths import check_writable_dir


def scalars(metrics: dict) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        name = key.replace(" ", "_")
        if isinstance(value, (list, tuple)):
            out.update({f"{name}/stage{s}": float(v) for s, v in enumerate(value)})
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
    return out


def tensorboard_problem(train) -> str | None:
    """Why --tensorboard-dir cannot be used (one line), or None; makes the directory."""
    path = train.tensorboard_dir
    if not path:
        return None
    check_writable_dir(path, "--tensorboard-dir")
    if importlib.util.find_spec("tensorboard") is None:
        return ("--tensorboard-dir needs the tensorboard package: pip install tensorboard (or "
                "megatron_2bw[tensorboard])")
    return None


def check_tensorboard(train) -> None:
    """One-line ConfigError when --tensorboard-dir cannot be used (before any process group)."""
    problem = tensorboard_problem(train)
    if problem:
        raise ConfigError(problem)


def check_loggers(train) -> None:
    """Every problem of --tensorboard-dir and --wandb-project in one ConfigError (one line),
    before any process group."""
    problems = [p for p in (tensorboard_problem(train),
                            wandb_problem("--wandb-project") if train.wandb_project else None)
                if p]
    if problems:
        raise ConfigError("; ".join(problems))


def wandb_mode(environ=os.environ) -> str:
    """WANDB_MODE as the user set it (online, offline, disabled, ...); offline when unset."""
    return environ.get("WANDB_MODE") or "offline"


class WandbWriter:
    """A wandb run whose step is the iteration. `project`, `entity`, `group`: the run's, when
    they are not the config's (DeepSpeed's monitor section)."""

    def __init__(self, cfg, project: str | None = None, entity: str | None = None,
                 group: str | None = None):
        t = cfg.train
        problem = wandb_problem("--wandb-project")
        if problem:  # train() called without pretrain's check: the same line
            raise ConfigError(problem)
        import wandb
        save_dir = t.wandb_save_dir or os.path.join(t.save or ".", "wandb")
        os.makedirs(save_dir, exist_ok=True)
        self.mode = wandb_mode()
        extra = {k: v for k, v in (("entity", entity or t.wandb_entity),
                                   ("group", group or t.wandb_group)) if v}
        self.run = wandb.init(project=project or t.wandb_project, name=t.wandb_exp_name,
                              dir=save_dir, config=cfg.to_dict(), mode=self.mode, **extra)

    def write(self, iteration: int, values: dict[str, float]) -> None:
        if values:
            self.run.log(values, step=iteration)

    def write_rows(self, rows: list) -> None:
        for iteration, samples, tags in rows:
            self.run.log({**tags, "samples vs steps": float(samples)}, step=iteration)

    def close(self) -> None:
        self.run.finish()


class TensorBoardWriter:
    def __init__(self, cfg):
        check_tensorboard(cfg.train)  # train() called without pretrain's check: the same line
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(log_dir=cfg.train.tensorboard_dir,
                                    max_queue=cfg.train.tensorboard_queue_size)

    def write(self, iteration: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, iteration)
        self.writer.flush()

    def write_rows(self, rows: list) -> None:
        for iteration, samples, tags in rows:
            for tag, value in tags.items():
                self.writer.add_scalar(tag, value, iteration)
                self.writer.add_scalar(f"{tag} vs samples", value, samples)

    def close(self) -> None:
        self.writer.close()
