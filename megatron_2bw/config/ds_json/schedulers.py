"""DeepSpeed's learning-rate schedulers (WarmupLR, WarmupDecayLR, WarmupCosineLR): the "scheduler"
section as Settings (the nearest Megatron fields) plus `DeepSpeedLR`, the exact schedule, a
callable step -> lr that the engine takes in place of the Megatron one (`deepspeed_lr` is
DeepSpeed's arithmetic for the lr of a step)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_2bw.config.ds_json.keys import unknown_key
from megatron_2bw.config.ds_json.setting import Setting, fail

DS_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
_SCHED_PARAMS = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000,
                 "warmup_type": "log", "last_batch_iteration": -1},
    "WarmupDecayLR": {"total_num_steps": None, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
                      "warmup_num_steps": 1000, "warmup_type": "log", "last_batch_iteration": -1},
    "WarmupCosineLR": {"total_num_steps": None, "warmup_min_ratio": 0.0,
                       "warmup_num_steps": 1000, "cos_min_ratio": 0.0001, "warmup_type": "log",
                       "last_batch_iteration": -1},
}
_DECAY_STYLE = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}


def _checked_params(kind: str, given: dict) -> dict:
    """The scheduler's parameters, DeepSpeed's defaults filled in, each checked."""
    defaults = _SCHED_PARAMS[kind]
    for k in given:
        if k not in defaults:
            unknown_key(k, defaults, f"scheduler.params ({kind})")
    p = {**defaults, **given}
    steps = p["warmup_num_steps"]
    if not isinstance(steps, int) or isinstance(steps, bool) or steps <= 0:
        fail(f"DeepSpeed config: scheduler.params.warmup_num_steps must be a positive integer, "
             f"got {steps!r}")
    if p["warmup_type"] not in ("log", "linear"):
        fail(f"DeepSpeed config: scheduler.params.warmup_type must be 'log' or 'linear', got "
             f"{p['warmup_type']!r}")
    if "total_num_steps" in defaults and (not isinstance(p["total_num_steps"], int)
                                          or p["total_num_steps"] < 1):
        fail(f"DeepSpeed config: {kind} needs scheduler.params.total_num_steps (a positive "
             "integer)")
    if p["last_batch_iteration"] != -1:
        fail("DeepSpeed config: scheduler.params.last_batch_iteration other than -1 is not "
             "supported: resume from a checkpoint instead")
    return p


def scheduler_section(ds: dict) -> tuple[str, dict, dict] | None:
    """(type, params with DeepSpeed's defaults, params the JSON gives) of the "scheduler"
    section, checked; None without one."""
    sch = ds.get("scheduler")
    if sch is None:
        return None
    kind = sch.get("type") if isinstance(sch, dict) else None
    if kind not in DS_SCHEDULERS:
        fail(f"DeepSpeed config: scheduler type {kind!r} is not supported: use one of "
             f"{', '.join(DS_SCHEDULERS)}")
    given = dict(sch.get("params") or {})
    return kind, _checked_params(kind, given), given


def scheduler_settings(ds: dict, lr: float) -> list[Setting]:
    """The Megatron fields nearest to the "scheduler" section (--lr-warmup-iters, --lr-decay-*,
    --min-lr, ...); the exact schedule is `DeepSpeedLR`."""
    section = scheduler_section(ds)
    if section is None:
        return []
    kind, p, given = section

    def param(name, flag, path, value):
        return Setting(f"scheduler.params.{name}", flag, path, value, name in given)

    key = f"scheduler ({kind})"
    out = [param("warmup_num_steps", "--lr-warmup-iters", "optimizer.lr_warmup_iters",
                 p["warmup_num_steps"])]
    style = Setting(key, "--lr-decay-style", "optimizer.lr_decay_style", _DECAY_STYLE[kind])
    if kind == "WarmupCosineLR":
        out.append(style)
    else:
        if kind == "WarmupDecayLR" or p["warmup_max_lr"] is not None:
            out.append(param("warmup_max_lr", "--lr", "optimizer.lr", float(p["warmup_max_lr"])))
        out.append(param("warmup_min_lr", "--min-lr", "optimizer.min_lr",
                         float(p["warmup_min_lr"])))
        out.append(style)
    if kind != "WarmupLR":  # total_num_steps is required (checked above), so always given
        out.append(param("total_num_steps", "--lr-decay-iters", "optimizer.lr_decay_iters",
                         p["total_num_steps"]))
    if kind == "WarmupCosineLR":
        out.append(param("cos_min_ratio", "--min-lr", "optimizer.min_lr",
                         lr * float(p["cos_min_ratio"])))
    return out


# -- DeepSpeed's learning-rate schedules, exactly --------------------------------------------------
@dataclass(frozen=True)
class DeepSpeedLR:
    """The "scheduler" section as the engine's lr schedule: `DeepSpeedLR(...)(k)` is the lr of
    the optimizer step that follows k applied steps (DeepSpeed's arithmetic, `deepspeed_lr`).
    `base_lr` is the optimizer's lr (the --lr flag or optimizer.params.lr)."""
    type: str
    params: dict
    base_lr: float

    @classmethod
    def from_json(cls, ds: dict, base_lr: float) -> "DeepSpeedLR | None":
        section = scheduler_section(ds)
        return None if section is None else cls(section[0], section[1], base_lr)

    @property
    def total_num_steps(self) -> int | None:
        return self.params.get("total_num_steps")

    def __call__(self, step: int) -> float:
        return deepspeed_lr(self.type, self.params, self.base_lr, step)


def deepspeed_lr(kind: str, p: dict, base_lr: float, step: int) -> float:
    """lr of the optimizer step that follows `step` applied (non-skipped) steps, with DeepSpeed's
    arithmetic: the scheduler starts at last_batch_iteration = -1 and steps after every applied
    optimizer step, so step k uses the schedule at k - 1 (k = 0: the warm-up start)."""
    i = step - 1
    warm = max(2, int(p["warmup_num_steps"]))

    def gamma_warm(it):
        if p["warmup_type"] == "log":
            return math.log(it + 1) / math.log(warm)
        return it / warm

    if kind == "WarmupCosineLR":
        if i < 0:
            return 0.0
        if i < warm:
            lo = p["warmup_min_ratio"]
            ratio = lo + gamma_warm(i) * (1.0 - lo)
        else:
            total = max(1, p["total_num_steps"] - warm)
            progress = min(1.0, (i - warm + 1) / total)
            lo = p["cos_min_ratio"]
            ratio = max(0.0, lo + (1.0 - lo) * (1 + math.cos(math.pi * progress)) / 2)
        return base_lr * ratio
    lo = float(p["warmup_min_lr"])
    hi = float(p["warmup_max_lr"]) if p.get("warmup_max_lr") is not None else base_lr
    if i < 0:
        return lo
    if i < warm:
        gamma = gamma_warm(i)
    elif kind == "WarmupLR":
        gamma = 1.0
    else:
        total = p["total_num_steps"]
        gamma = max(0.0, float(total - i) / float(max(1.0, total - warm)))
    return lo + (hi - lo) * gamma
