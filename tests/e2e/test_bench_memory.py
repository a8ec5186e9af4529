"""bench/memory.py, bench/grad_accumulation.py and bench/grad_reduce.py end to end (--tiny):
every engine buffer equals the memory model's bytes (distributed optimizer, gradient buffers,
low-precision gradient), both bf16 gradient-accumulation modes train bitwise alike, and so do
buckets started in the last backward and at R."""
import json

import pytest

from test_bench_scripts import _run


def test_memory_tiny_accounting_matches_the_planner_model(tmp_path):
    out = _run(["bench/memory.py", "--tiny", "--json", tmp_path / "m.json", "--schedules",
                "gpipe,flush,2bw,2bw+predict,2bw+predict-nesterov"])
    data = json.loads((tmp_path / "m.json").read_text())
    rows = {(r["schedule"], r["m"]): r for r in data["rows"]}
    assert set(rows) == {("gpipe", 2), ("flush", 2), ("2bw", 2), ("2bw+predict", 2),
                         ("2bw+predict-nesterov", 2)}
    for (sched, m), r in rows.items():
        for s in r["stages"]:
            model = s["model"]
            for key in ("weights", "master", "grads", "model_grad", "optimizer"):
                assert s[key] == model[key], (sched, s["stage"], key)
            # fp32: only a prediction keeps the real weights apart from the slots (one stage
            # buffer); predict-nesterov's optimizer keeps the gradient too (Adam: 2 + 1 copies)
            assert s["master"] == (4 * s["params"] if "+predict" in sched else 0)
            assert s["optimizer"] == 4 * s["params"] * (3 if "nesterov" in sched else 2)
            assert s["versions"] == (2 if sched.startswith("2bw") else 1)
            assert s["in_flight_peak"] == model["in_flight"], (sched, s["stage"])
            assert s["stash_peak"] > 0
            assert 0.5 < s["total"] / model["total"] < 1.5
    assert "target: 2bw m=2: stage-0 stash <= d=2 microbatches" in out


@pytest.mark.parametrize("run,precision,w", [
    ("2bw", ["--bf16"], 2), ("flush", ["--bf16", "--grad-accumulation", "buffer"], 2),
    pytest.param("2bw", ["--bf16"], 4, marks=pytest.mark.slow),
    pytest.param("2bw+predict", [], 2, marks=pytest.mark.slow)],
    ids=["bf16-w2", "bf16-flush-w2-buffer", "bf16-w4", "fp32-predict-w2"])
def test_memory_tiny_distributed_optimizer_holds_one_wth_of_the_state(tmp_path, run, precision,
                                                                       w):
    """2BW (bf16; fp32 with --2bw-compensation predict, whose master is sharded too) at w with
    and without --use-distributed-optimizer: every buffer equals the memory model's bytes, and
    master weights + optimizer state shrink to 1/w (exactly, up to the padding of each of the
    stage's at most two regions to a multiple of w). bf16 keeps a low-precision gradient
    buffer only with --grad-accumulation buffer (issue 32: by default backward adds into fp32)."""
    out = _run(["bench/memory.py", "--tiny", "--schedules", run, "--data-parallel-size", str(w),
                *precision, "--distributed-optimizer", "both", "--json", tmp_path / "m.json"])
    data = json.loads((tmp_path / "m.json").read_text())
    rows = {r["distributed_optimizer"]: r for r in data["rows"]}
    assert set(rows) == {False, True}
    for dist, r in rows.items():
        assert r["replicas_alike"]
        for s in r["stages"]:
            for key in ("weights", "master", "grads", "model_grad", "optimizer"):
                assert s[key] == s["model"][key], (dist, s["stage"], key)
            assert (s["model_grad"] >= 2 * s["params"]) == ("buffer" in precision) and \
                (s["model_grad"] == 0) == ("buffer" not in precision), (dist, s["stage"])
    for sharded, whole in zip(rows[True]["stages"], rows[False]["stages"]):
        for key, per_element in (("master", 4), ("optimizer", 8)):  # fp32; Adam's two moments
            padding = (sharded[key] * w - whole[key]) // per_element
            assert whole[key] > 0 and 0 <= padding <= 2 * (w - 1), (key, sharded, whole)
        assert sharded["weights"] == whole["weights"] and sharded["grads"] == whole["grads"]
    assert out.count("= the memory model's") == 2 and "-> MISSED" not in out
    assert "Bytes per parameter of each stage" in out


@pytest.mark.slow  # tests/unit/test_grad_buffers.py checks the same bytes in-process
def test_memory_tiny_one_gradient_buffer_matches_the_planner_model(tmp_path):
    """Issue 32: `--2bw-grad-buffers 1`: a 2BW stage holds one fp32 gradient buffer (and each
    slot's loss element), to the byte of the memory model; weights, master and optimizer as
    with two."""
    from megatron_2bw.config.control_flags import TAIL
    _run(["bench/memory.py", "--tiny", "--json", tmp_path / "m.json", "--schedules", "2bw",
          "--2bw-grad-buffers", "1"])
    rows = json.loads((tmp_path / "m.json").read_text())["rows"]
    assert len(rows) == 1
    for s in rows[0]["stages"]:
        for key in ("weights", "master", "grads", "model_grad", "optimizer"):
            assert s[key] == s["model"][key], (s["stage"], key)
        assert s["versions"] == 2 and s["weights"] == 2 * 4 * s["params"]
        assert s["grads"] == (s["params"] + TAIL) * 4 + 2 * 4


def test_grad_accumulation_tiny_both_modes_train_bitwise_alike(tmp_path):
    """Issue 32 point 2: bench/grad_accumulation.py times bf16 --grad-accumulation fp32 against
    buffer side by side and checks their losses are bitwise equal on every batch."""
    out = _run(["bench/grad_accumulation.py", "--tiny", "--shapes", "small", "--json",
                tmp_path / "g.json"])
    rows = json.loads((tmp_path / "g.json").read_text())["results"]["small"]["rows"]
    from megatron_2bw.schedule.kinds import schedule_names
    assert [r["schedule"] for r in rows] == list(schedule_names())
    assert all(r["losses_equal"] and r["fp32"] > 0 and r["buffer"] > 0 for r in rows)
    assert out.count("bitwise equal") == len(rows)


def test_grad_reduce_tiny_starts_buckets_early_and_trains_bitwise_alike(tmp_path):
    """Issue 32 point 1: bench/grad_reduce.py times buckets started in the last backward against
    all at R on two data-parallel ranks; the losses are bitwise equal and buckets did start
    early (the script fails otherwise)."""
    out = _run(["bench/grad_reduce.py", "--tiny", "--shapes", "small", "--json",
                tmp_path / "r.json"])
    rows = json.loads((tmp_path / "r.json").read_text())["results"]["small"]["rows"]
    from megatron_2bw.schedule.kinds import schedule_names
    assert [r["schedule"] for r in rows] == list(schedule_names())
    assert all(r["losses_equal"] and r["buckets"] >= 2 and r["started_early"] > 0 for r in rows)
    assert out.count("bitwise equal") == len(rows)
