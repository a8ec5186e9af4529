"""pretrain_gpt.py refuses a bad architecture layout (grouped-query attention groups that the
tensor size does not divide) in one line, before any process group."""


def test_pretrain_rejects_bad_groups_before_any_process_group(tmp_path):
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(root / "pretrain_gpt.py"), "--mock-data",
                           "--model", "llama-debug", "--tensor-model-parallel-size", "4"],
                          capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(root), "WORLD_SIZE": "4", "RANK": "0",
                               "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "error: --num-query-groups 2 is not divisible by --tensor-model-parallel-size 4: every "
        "tensor rank holds whole query groups; use a multiple of 4 groups or a smaller tensor "
        "size"]
