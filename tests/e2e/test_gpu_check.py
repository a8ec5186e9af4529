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
        "--seq-length", "16", "--vocab-size", "128",
        "--attention-dropout", "0")  # torch's CPU flash attention takes no dropout


def _cli(*args):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "tools/gpu_check.py", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("gpus", [1, 2])
@pytest.mark.parametrize("quick", [False, True])
def test_dry_run_validates_the_plan(gpus, quick):
    r = _cli("--dry-run", "--gpus", str(gpus), *(["--quick"] if quick else []))
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    verified = (["2bw"] if quick else schedule_names()) if gpus >= 2 else []
    mode = "quick" if quick else "full"
    assert f"dry run ({mode}): {2 + len(verified)} steps for {gpus} GPU(s), all valid" in out
    assert "--model gpt-125m --seq-length 1024 --vocab-size 50304" in out and "--bf16" in out
    assert "--distributed-backend nccl" in out
    assert "--nproc_per_node=1 -m megatron_2bw.cli.pretrain_gpt" in out
    exit_at, end = (30, 50) if quick else (100, 150)
    assert f"--train-iters {end} " in out and f"--exit-interval {exit_at}" in out
    assert "--load" in out and "--trace" in out and "--profile" in out
    for name in schedule_names():
        verify = f"-m megatron_2bw.testing.verify --distributed-backend nccl --schedule {name}"
        assert (verify in out) == (name in verified)
    assert "planner memory model of the train step:" in out
    assert ("requirements: MFU >= 35%, attention flash or cudnn, fused AdamW, TF32 fp32 "
            "matmuls") in out
    assert G.Settings.quick_mode(gpus=1, work_dir=".").time_limit_s < 120  # --quick: < 2 min


def _measured(mfu=0.5, attention=("flash",), fused=True, fp32="tf32"):
    return {"train": {"mfu": mfu},
            "kernels_ran": {"attention": list(attention), "fused_adamw": fused},
            "kernels": {"attention": "flash", "optimizer": "torch-fused", "fp32 matmul": fp32}}


def test_a_silent_fall_back_fails_the_check():
    req = G.Requirements()
    assert G.failed_requirements(_measured(), req) == []
    assert G.failed_requirements(_measured(attention=("cudnn",)), req) == []
    for bad, word in [(_measured(mfu=0.2), "MFU 20.0% is below the 35% floor"),
                      (_measured(mfu=None), "MFU n/a"),
                      (_measured(attention=("math",)), "attention ran as math"),
                      (_measured(attention=("flash", "efficient")), "ran as flash, efficient"),
                      (_measured(attention=()), "nothing recorded"),
                      (_measured(fused=False), "fused AdamW kernel"),
                      (_measured(fp32="ieee"), "fp32 matmuls run as ieee")]:
        problems = G.failed_requirements(bad, req)
        assert len(problems) == 1 and word in problems[0], (word, problems)
    assert G.failed_requirements(_measured(mfu=0.2), G.Requirements(mfu_floor=0.1)) == []


def test_the_profiled_kernels_are_read_from_the_trace(tmp_path):
    events = [{"name": "aten::_scaled_dot_product_flash_attention"}, {"name": "aten::mm"},
              {"name": "aten::_fused_adamw_"}]
    (tmp_path / "rank0.iter1-2.pt.trace.json").write_text(json.dumps({"traceEvents": events}))
    got = G.profiled_kernels(str(tmp_path))
    assert got["attention"] == ["flash"] and got["fused_adamw"]
    events[0]["name"] = "aten::_scaled_dot_product_attention_math"
    events[2]["name"] = "aten::add_"
    (tmp_path / "rank0.iter1-2.pt.trace.json").write_text(json.dumps({"traceEvents": events}))
    got = G.profiled_kernels(str(tmp_path))
    assert got["attention"] == ["math"] and not got["fused_adamw"]


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
                   precision=(), backend="gloo", timeouts={"train": 120, "resume": 120},
                   require=G.Requirements(mfu_floor=None, tf32=False))  # no TF32 on a CPU
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
    # what the profiler saw run (CPU: flash attention for CPU, torch's fused AdamW)
    assert out["kernels_ran"]["attention"] == ["flash"] and out["kernels_ran"]["fused_adamw"]
    assert out["kernels"] == {"attention": "flash", "optimizer": "torch-fused",
                              "fp32 matmul": "ieee"}
    s.require = G.Requirements(mfu_floor=0.99)  # the same run judged on a GPU's terms: FAIL
    out = G.summarize(s, {k: (tmp_path / f"{k}.log").read_text() for k in ("train", "resume")},
                      {"train": 0, "resume": 0}, 100.0, out["planner_memory_gib"],
                      str(tmp_path / "checkpoints" / "profile"))
    assert not out["passed"] and len(out["problems"]) == 2
    assert "below the 99% floor" in out["problems"][0] and "not tf32" in out["problems"][1]
    saved = json.loads((tmp_path / "c.json").read_text())
    assert saved["device"] == "cpu" and saved["passed"]
    assert (tmp_path / "train.log").read_text().count("iteration") >= 2
