"""Watching a run: what is logged, where it goes, and what it costs (nothing in the hot path).

Owns: the interval's log fields (interval_log.py), Megatron's console lines and their parser
(log_line.py), the logger that prints them and feeds the writers (logger.py),
pace, ETA and the progress bar (progress.py), wandb and TensorBoard (writers.py), peak memory per
stage (memory.py), --profile traces (profiling.py), the straggler report (straggler.py) and the
peak throughput of known accelerators for MFU (devices.py).
Must not import: schedule, pipeline, tensor_parallel, parallel, optim, data, checkpoint, planner,
deepspeed, testing, pretrain, generate.
"""
