"""`deepspeed.runtime.pipe`: DeepSpeed's pipeline runtime names.

Owns: schedule.py (DeepSpeed's `TrainSchedule` / `InferenceSchedule` and instruction classes as a
view of the flush and forward action tables of schedule/), topology.py (DeepSpeed's topologies and
`PipelineParallelGrid`, the grid as an `mpu`).
Must not import: data, planner, testing, pretrain, generate, training, checkpoint, pipeline.
"""
