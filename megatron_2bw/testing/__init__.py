"""The judges: what every parallel feature is proven against. Never imported by the product
(tests/unit/test_layout.py fails if anything outside testing/ imports it); tests, tools and
bench do.

Owns: the equivalence check (verify.py, `tools/verify_equivalence.py`: t*d*w gloo processes
against the single-process reference), the single-process references of docs/ARCHITECTURE.md
section 1 in plain PyTorch (reference.py), the prepared GPU check (gpu_check.py,
`tools/gpu_check.py`: train, resume and verify on a GPU node, judged by gpu_check_report.py)
and reading an offline wandb run back (wandb_offline.py). Running a function on N local
processes is product code (training/spawn.py).
Must not import: generate, cli.
The judges may import any product package; they run the entry points as commands (the GPU
check's dry run reads its steps' flags through pretrain.parse, the front door they start with).
"""
