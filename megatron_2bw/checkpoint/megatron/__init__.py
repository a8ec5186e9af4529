"""Megatron's checkpoints: megatron-core's torch_dist directories and `--ckpt-format torch` files
(megatron-core or legacy parameter names) load here, and ours are written back in megatron-core's
torch_dist format.

    mapping.py   the one name and layout map between Megatron and this project: megatron-core's
                 module names, its sharded (stacked-layer) keys, the legacy names (also what
                 Megatron-DeepSpeed writes per layer), QKV per query group, SwiGLU's fc1
                 [gate; up], tensor-parallel split dims, boxes of global tensors both ways

Owns: reading and writing Megatron-LM / megatron-core checkpoints, through mapping.py.
Must not import: planner, deepspeed, testing, pretrain, generate.
"""
