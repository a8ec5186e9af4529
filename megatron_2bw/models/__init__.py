"""The GPT and BERT models as lists of layer specs, and how a list is cut into stages.

Owns: the model families (families.py: one `ModelFamily` each and `model_parts`, the one way to
build a configured model's specs, loss and stage boundaries), the layers (gpt.py, bert.py,
transformer.py, attention.py, mlp.py, norms.py, rope.py, recompute.py), parameter/FLOP/activation
counts (flops.py), the one partitioner (partition.py) and `LayerSpec` / `StageModule` (stage.py: per-layer seeds, tied weights).
Must not import: schedule, pipeline, parallel, optim, checkpoint, training, planner, deepspeed,
testing, pretrain, generate.
"""
