"""Training logs: one console line per log interval from the last pipeline stage, the same
numbers to wandb (offline unless WANDB_MODE says otherwise), and memory per stage."""
from __future__ import annotations

import os
import re
import resource

import torch


def memory_gb(device) -> float:
    """Peak memory of this process: CUDA allocator peak on a GPU, peak RSS on the CPU."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # KB on Linux


def memory_per_stage(grid, device) -> list[float]:
    """Collective: the peak memory of each pipeline stage (max over its tensor/data ranks)."""
    values = [0.0] * grid.world_size
    values[grid.rank] = memory_gb(device)
    values = grid.comm.reduce_floats(values) if grid.world_size > 1 else values
    per_stage = [0.0] * grid.pipeline
    for r in range(grid.world_size):
        s = grid.coords(r)[1]
        per_stage[s] = max(per_stage[s], float(values[r]))
    return per_stage


class TrainLogger:
    def __init__(self, cfg, grid, reporter: bool, print_fn=print):
        self.cfg, self.reporter, self.print = cfg, reporter, print_fn
        self.wandb = None
        if reporter and cfg.train.wandb_project:
            os.environ.setdefault("WANDB_MODE", "offline")
            import wandb
            save_dir = cfg.train.wandb_save_dir or os.path.join(cfg.train.save or ".", "wandb")
            os.makedirs(save_dir, exist_ok=True)
            self.wandb = wandb.init(project=cfg.train.wandb_project,
                                    name=cfg.train.wandb_exp_name, dir=save_dir,
                                    config=cfg.to_dict())

    def log(self, iteration: int, metrics: dict) -> None:
        if not self.reporter:
            return
        fields = [f"iteration {iteration:6d}/{self.cfg.train.train_iters}"]
        for key, value in metrics.items():
            if isinstance(value, float):
                value = f"{value:.3e}" if key == "lr" else f"{value:.4g}"
            elif isinstance(value, list):
                value = "[" + ", ".join(f"{v:.2f}" for v in value) + "]"
            fields.append(f"{key} {value}")
        self.print(" | ".join(fields))
        if self.wandb is not None:
            self.wandb.log({k.replace(" ", "_"): v for k, v in metrics.items()
                            if not isinstance(v, list)}, step=iteration)

    def finish(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def parse_line(line: str) -> tuple[int, dict] | None:
    """(iteration, {key: value}) of a line `TrainLogger.log` printed (numbers as floats, lists
    as lists of floats, anything else as text); None for any other line."""
    m = re.match(r"\s*iteration\s+(\d+)/\d+ \| (.*)$", line)
    if not m:
        return None
    fields = {}
    for part in m.group(2).split(" | "):
        kv = re.match(r"(.*?) (\[.*\]|\S+)$", part.strip())
        if kv:
            key, value = kv.groups()
            fields[key] = ([float(x) for x in value.strip("[]").split(",") if x.strip()]
                           if value.startswith("[") else _number(value))
    return int(m.group(1)), fields


def _number(text: str):
    try:
        return float(text)
    except ValueError:
        return text
