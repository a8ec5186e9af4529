"""Optimizers over one flat fp32 buffer, their kernels, loss scaling and the lr schedule.

Owns: the flat AdamW / SGD optimizers (optimizer.py: `make_optimizer`, step src -> dst so 2BW
writes the new version beside the one in use), which kernel steps them (kernels.py: torch-fused,
apex, unfused, and the opt-in native C kernel of native.py / native_adam.c), the distributed
optimizer (distributed.py, ZeRO-1) and how it cuts the buffers (shard_layout.py), fp16 loss
scaling (loss_scale.py) and Megatron's lr schedule (lr.py).
Must not import: schedule, pipeline, models, tensor_parallel, parallel, data, checkpoint, training,
planner, deepspeed, testing, pretrain, generate.
"""
import importlib

_EXPORTS = {"make_loss_scaler": "loss_scale", "LRSchedule": "lr", "make_optimizer": "optimizer"}


def __getattr__(name: str):
    """Load the torch-backed modules on first use (`optim.shard_layout` stays torch-free for the
    planner)."""
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"megatron_2bw.optim.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'megatron_2bw.optim' has no attribute {name!r}")


__all__ = ["LRSchedule", "make_loss_scaler", "make_optimizer"]
