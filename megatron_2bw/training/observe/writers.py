"""Where the logged numbers go besides the console: wandb and TensorBoard, the same scalars.

`scalars(metrics)` is the one mapping from a log line's fields to scalar names, for both:
spaces become underscores ("grad norm" -> "grad_norm"), a per-stage list becomes one scalar per
stage ("memory GB per stage" -> "memory_GB_per_stage/stage0", ...), text (the ETA) is left out.
The step is the iteration. Both writers run on the reporting rank (last stage, first data and
tensor rank), need no network (wandb is offline unless WANDB_MODE says otherwise) and can be on
together.

Megatron's tags (`lm loss`, `learning-rate`, `grad-norm`, `loss-scale`, `batch-size`,
`iteration-time`, `lm loss validation`, `lm loss validation ppl`, ...) come as rows (iteration,
samples, {tag: value}) through `write_rows`: TensorBoard writes each at the iteration and again as
`<tag> vs samples` at the consumed samples (Megatron's two series); wandb logs them at the
iteration with `consumed-samples` beside them.

- wandb (`--wandb-project`): a run under `--wandb-save-dir` (default {save}/wandb), in the mode
  WANDB_MODE says (offline when it is unset).
- TensorBoard (`--tensorboard-dir DIR`): event files written by
  `torch.utils.tensorboard.SummaryWriter` (the tensorboard package, imported only when asked for;
  `check_tensorboard` says so in one line before any process group, and again if a caller of
  `training.train` skipped it). Flushed at every log interval, so a run that stops on an error
  keeps every interval it logged.
"""
from __future__ import annotations

import importlib.util
import os

from megatron_2bw.config import ConfigError
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


def check_tensorboard(train) -> None:
    """One-line ConfigError when --tensorboard-dir cannot be used (before any process group)."""
    path = train.tensorboard_dir
    if not path:
        return
    check_writable_dir(path, "--tensorboard-dir")
    if importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("--tensorboard-dir needs the tensorboard package: pip install "
                          "tensorboard (or megatron_2bw[tensorboard])")


def wandb_mode(environ=os.environ) -> str:
    """WANDB_MODE as the user set it (online, offline, disabled, ...); offline when unset."""
    return environ.get("WANDB_MODE") or "offline"


class WandbWriter:
    def __init__(self, cfg):
        t = cfg.train
        import wandb
        save_dir = t.wandb_save_dir or os.path.join(t.save or ".", "wandb")
        os.makedirs(save_dir, exist_ok=True)
        self.mode = wandb_mode()
        self.run = wandb.init(project=t.wandb_project, name=t.wandb_exp_name, dir=save_dir,
                              config=cfg.to_dict(), mode=self.mode)

    def write(self, iteration: int, values: dict[str, float]) -> None:
        self.run.log(values, step=iteration)

    def write_rows(self, rows: list) -> None:
        for iteration, samples, tags in rows:
            self.run.log({**tags, "consumed-samples": float(samples)}, step=iteration)

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
