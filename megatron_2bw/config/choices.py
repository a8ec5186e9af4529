"""The settings' vocabularies (the values each choice may take) and `ConfigError`, the one error
type of a bad setting. Pure data: no torch, imported by every layer that validates anything.
The schedule and compensation names come from their owners (schedule/kinds.py,
schedule/compensation_methods.py); this module only lists them for the config's checks.
"""
from __future__ import annotations

from megatron_2bw.schedule.compensation_methods import NONE as NO_COMPENSATION  # noqa: F401
from megatron_2bw.schedule.kinds import schedule_names

SCHEDULES = schedule_names()  # the schedule kinds own their names and rules (schedule/kinds.py)
PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZERS = ("adam", "sgd")
RANK_ORDERS = ("tp-dp-pp", "tp-pp-dp")
RECOMPUTE_METHODS = ("uniform", "block")
RECOMPUTE_GRANULARITIES = ("selective", "full")
LR_DECAY_STYLES = ("constant", "linear", "cosine")
# --grad-accumulation (pipeline/weights.py): each parameter's gradient into fp32 as backward makes
# it (Megatron's main_grad), or a stage-sized bf16/fp16 buffer folded after every backward
GRAD_ACCUMULATIONS = ("fp32", "buffer")
# checkpoint/api.py; Megatron's names, its default first; "megatron": megatron-core's torch_dist
# layout and names (checkpoint/megatron/export.py), which Megatron-LM loads
CKPT_FORMATS = ("torch_dist", "torch", "megatron")


class ConfigError(ValueError):
    """A bad setting. The message is one line: what is wrong and how to fix it."""


MODEL_FAMILIES = ("gpt", "bert")
