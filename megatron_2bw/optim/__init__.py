"""Optimizers over one flat fp32 buffer, their kernels, loss scaling and the lr schedule.

Owns: the flat AdamW / SGD optimizers (optimizer.py: `make_optimizer`, step src -> dst so 2BW
writes the new version beside the one in use), which kernel steps them (kernels.py: torch-fused,
apex, unfused, and the opt-in native C kernel of native.py / native_adam.c), the distributed
optimizer (distributed.py, ZeRO-1) and how it cuts the buffers (shard_layout.py), fp16 loss
scaling (loss_scale.py) and Megatron's lr schedule (lr.py).
Must not import: schedule, pipeline, models, tensor_parallel, parallel, data, checkpoint, training,
planner, deepspeed, testing, pretrain, generate.
"""
from megatron_2bw.optim.loss_scale import make_loss_scaler
from megatron_2bw.optim.lr import LRSchedule
from megatron_2bw.optim.optimizer import make_optimizer

__all__ = ["LRSchedule", "make_loss_scaler", "make_optimizer"]
