"""Checkpoints with exact resume: one front door, two formats, converters.

Owns: the front door (api.py: save, start, load, preflight; loading detects the format), the
directory's files and whole-save rules (files.py: `latest`, iteration dirs, checksums, pruning),
what a checkpoint was saved for (layout.py), global parameter names (names.py), Megatron's
one-file-per-stage format (torch_format.py), the layout-free torch_dist format on DCP (dist/, the
default), when an async save is published (saver.py), resuming on a new allocation (resume.py),
`tools/checkpoint_inspect.py` (inspect.py), the converters (convert/: native, HuggingFace,
torch -> torch_dist, -> megatron-core) and Megatron's own checkpoints (megatron/: megatron-core
torch_dist and Megatron's torch format read into any layout, ours written in megatron-core's
format, through the one name and layout map megatron/mapping.py) and reading DeepSpeed's pipeline
checkpoints (deepspeed_pipe/: Megatron-DeepSpeed's GPT for --load, the files and ZeRO state the
drop-in reads). Every write goes through fs.py
or dist/storage.py.
Must not import: training, planner, deepspeed, testing, pretrain, generate.
"""
