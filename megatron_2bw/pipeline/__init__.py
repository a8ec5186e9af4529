"""The pipeline engine: a small interpreter of one stage's schedule actions; it owns no policy
(the schedule kinds of schedule/ do).

Owns: `PipelineEngine` (engine.py: windows of the stage's table, validated once per shape), the
action interpreter and its p2p grouping (interpreter.py), the batch actions R/N/S (batch_step.py:
bucketed reductions, global norm, clipping, loss scaling, the step into the slot the kind names),
the flat weight buffers per version slot (weights.py), 2BW staleness compensation
(compensation.py), the control flags carried in the per-batch reductions (flags.py), action
timers (timers.py), the CPU heap policy (host_memory.py) and the leaf of failure handling that
checkpoints and training share (faults.py: NumericsError, FaultHooks).
Must not import: tensor_parallel, data, checkpoint, training, planner, deepspeed, testing,
pretrain, generate.
"""
