"""The control flags' names and the gradient buffer's tail, without torch (the planner's memory
model imports them; pipeline/flags.py and pipeline/weights.py use them)."""
FLAGS = ("preempt", "exit_duration", "save_busy")
TAIL = 1 + len(FLAGS)  # loss, then one slot per control flag

__all__ = ["FLAGS", "TAIL"]
