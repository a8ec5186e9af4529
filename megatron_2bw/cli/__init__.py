"""The commands: the code of the console scripts (pyproject.toml's [project.scripts]), which the
checkout's pretrain_*.py and tools/*.py wrap, so `m2bw-plan ...` (installed) and
`python tools/plan.py ...` (checkout) run the same code.

Owns: pretraining entries (pretrain_gpt.py, pretrain_bert.py), preprocess_data.py,
train_tokenizer.py, compare_convergence.py (+ convergence_report.py: its CSV, table and PNG),
plot_schedule.py (pipeline timelines, from the schedules or from engine traces:
pipeline/trace_file.py) and figures.py (the README's pictures). The other commands' code
stays with what they command: planner/cli.py (m2bw-plan), checkpoint/convert/cli.py
(m2bw-convert), checkpoint/inspect.py (m2bw-inspect), generate.py (m2bw-generate) and the
judges' own commands in testing/ (m2bw-verify: verify.py, m2bw-gpu-check: gpu_check.py).
Nothing imports it and it imports no judge (tests/unit/test_layout.py).
Must not import: deepspeed, testing.
"""
