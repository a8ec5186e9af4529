"""A training run around the engine: building it from the config, the loop, failures, logs.

Owns: building a run (build.py: this rank's engine through `models.families.model_parts`, its
data role, its microbatches; the grid is `ProcessGrid.from_config`), the training loop (loop.py: train, evaluate,
save every --save-interval, resume, log), failure handling (reliability.py: the launcher watch,
preemption, non-finite stops; its leaf, NumericsError and the fault hooks, is
pipeline/faults.py), running a function on N local processes (spawn.py: compare_convergence, the
judges and tests) and observability (observe/).
Must not import: schedule, optim, planner, deepspeed, testing, pretrain, generate.
"""
