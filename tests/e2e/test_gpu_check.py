"""tools/gpu_check.py: its plan validates through the real parsers (--dry-run, with 1 and 2
pretend GPUs), a bad plan is reported per step, its log parser reads the training logger's
format, and the whole check (train, save, resume with --load, evaluation, timers and trace,
summary) runs end to end on CPU with a tiny model over gloo."""
import json
import os
import subprocess
import sys

import pytest

from megatron_2bw.schedule.kinds import schedule_names

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import gpu_check as G  # noqa: E402

TINY = ("--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--vocab-size", "128")


def _cli(*args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "tools/gpu_check.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("gpus", [1, 2])
def test_dry_run_validates_the_plan(gpus):
    r = _cli("--dry-run", "--gpus", str(gpus))
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    verifies = len(schedule_names()) if gpus >= 2 else 0
    assert f"dry run: {2 + verifies} steps for {gpus} GPU(s), all valid" in out
    assert "--model gpt-125m --seq-length 1024 --vocab-size 50304" in out and "--bf16" in out
    assert "--distributed-backend nccl" in out and "--nproc_per_node=1 pretrain_gpt.py" in out
    assert "--exit-interval 100" in out and "--load" in out and "--trace" in out
    for name in schedule_names():
        assert (f"verify_equivalence.py --distributed-backend nccl --schedule {name}" in out) == \
            (gpus >= 2)
    assert "planner memory model of the train step:" in out


def test_a_bad_plan_is_reported_per_step(tmp_path):
    s = G.Settings(gpus=2, work_dir=str(tmp_path), micro_batch=7)  # 64 is not a multiple of 7
    lines = []
    assert G.dry_run(s, echo=lines.append) == 1
    problems = [x for x in lines if x.startswith("problem:")]
    assert len(problems) == 2 and all("global" in x and "batch" in x for x in problems)
    assert problems[0].startswith("problem: step train:")
    s = G.Settings(gpus=1, work_dir=str(tmp_path / "f" / "x"))
    (tmp_path / "f").write_text("a file, not a directory")
    assert any("not writable" in x for x in G.validate(G.plan(s), s))


def test_the_log_parser_reads_the_logger():
    G.check_log_parser()  # raises if the logger's format drifted
    log = G.parse_log("megatron-2bw: 124.44M parameters (12 layers, ...)\n"
                      "iteration     20/150 | loss 6.5 | memory GB per stage [1.50, 2.25]\n")
    assert log["parameters_m"] == 124.44
    assert log["iterations"] == [{"iteration": 20, "loss": 6.5,
                                  "memory GB per stage": [1.5, 2.25]}]


def test_device_peaks():
    from megatron_2bw.training.observe.devices import peak_tflops
    assert peak_tflops("NVIDIA H200") == 989.0 and peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0 and peak_tflops("NVIDIA A10") == 125.0
    assert peak_tflops("NVIDIA L40S") == 362.0 and peak_tflops("Tesla V100-SXM2") is None


@pytest.mark.slow  # two pretrain launches: about 30 s on a loaded 2-core machine
def test_the_check_runs_end_to_end_on_cpu(tmp_path):
    s = G.Settings(gpus=1, work_dir=str(tmp_path), exit_iters=2, train_iters=4, micro_batch=2,
                   global_batch=4, log_interval=1, eval_interval=2, eval_iters=1, model=TINY,
                   precision=(), backend="gloo", timeouts={"train": 120, "resume": 120})
    lines = []
    out = G.execute(s, peak=100.0, device="cpu", out_path=str(tmp_path / "c.json"),
                    echo=lines.append)
    text = "\n".join(lines)
    assert out["passed"], text
    assert out["resumed_correctly"] and out["steps"] == {"train": "ok", "resume": "ok"}
    assert [it for it, _ in out["validation_losses"]] == [2, 4]
    assert out["trace_events"] > 0 and {"forward", "backward"} <= set(out["breakdown_ms"])
    assert out["train"]["step_time_s"] > 0 and out["train"]["mfu"] > 0
    assert out["planner_memory_gib"]["total"] > 0 and out["train"]["peak_memory_gib"] > 0
    assert text.rstrip().endswith("PASS") and "MFU" in text
    saved = json.loads((tmp_path / "c.json").read_text())
    assert saved["device"] == "cpu" and saved["passed"]
    assert (tmp_path / "train.log").read_text().count("iteration") >= 2
