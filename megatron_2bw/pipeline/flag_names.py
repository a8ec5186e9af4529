"""The control flags' names, the gradient buffer's tail and the modes of bf16/fp16 gradient
accumulation, without torch (the planner's memory model and the config's checks import them;
pipeline/flags.py and pipeline/weights.py use them)."""
FLAGS = ("preempt", "exit_duration", "save_busy")
TAIL = 1 + len(FLAGS)  # loss, then one slot per control flag
# --grad-accumulation (pipeline/weights.py): each parameter's gradient into fp32 as backward makes
# it (Megatron's main_grad), or a stage-sized bf16/fp16 buffer folded after every backward
GRAD_ACCUMULATIONS = ("fp32", "buffer")

__all__ = ["FLAGS", "TAIL", "GRAD_ACCUMULATIONS"]
