"""Issue 30 point 7: the planner counts a 2BW compensation's step cost (each stage's S), from
a measured profile's own timing of it or, analytic, from the method's extra bytes per
parameter; schedules without one-step-stale weights are not charged."""
import json

import pytest

from megatron_2bw.models.flops import named_model
from megatron_2bw.planner import AnalyticProfile, MeasuredProfile, PlanError, Topology
from megatron_2bw.planner.cost_model import LayerTimes, Layout, Setup, stage_plan
from megatron_2bw.planner.profile import STEP_BYTES, compensation_bytes, profile_from_dict
from megatron_2bw.schedule.compensation_methods import NONE, method_names


def _steps(profile, schedule, compensation, model, d=2, m=4):
    topo = Topology(num_nodes=1, gpus_per_node=2, gpu_memory_gb=1e3)
    setup = Setup(model, "fp32", "adam", compensation=compensation)
    plan = stage_plan(setup, Layout(schedule, 1, d, 1, 1, m), LayerTimes(setup, profile, topo),
                      topo)
    return plan.step


def _measured(model, comp=None):
    times = {b: (1e-3 * b, 2e-3 * b) for b in (1, 2)}
    layers = {k: dict(times) for k in ("embedding", "transformer", "head")}
    return MeasuredProfile({}, layers, 2e-9, compensation_s_per_param=comp or {}).validate()


@pytest.mark.parametrize("name", [n for n in method_names() if n != NONE])
def test_the_step_of_a_compensated_2bw_stage_includes_the_methods_work(name):
    model = named_model("debug")
    for profile in (AnalyticProfile(), _measured(model), _measured(model, {name: 5e-9})):
        plain = _steps(profile, "2bw", NONE, model)
        comp = _steps(profile, "2bw", name, model)
        extra = [c - p for c, p in zip(comp, plain)]
        assert all(x > 0 for x in extra), (name, profile.source, extra)
        if profile.source == "measured":
            per = profile.compensation_s_per_param.get(
                name, profile.step_s_per_param * compensation_bytes(name, "fp32") / STEP_BYTES)
        else:
            per = compensation_bytes(name, "fp32") / (profile.memory_bandwidth_gb_per_s * 1e9)
        ratios = [x / per for x in extra]  # parameters per stage, the same for every profile
        assert ratios == pytest.approx([ratios[0] * r / ratios[0] for r in ratios])
        assert _steps(profile, "flush", NONE, model) == _steps(profile, "flush", NONE, model)
    assert compensation_bytes(NONE, "fp32") == 0.0
    # the Nesterov form moves the most, then the spike, then the plain prediction
    assert (compensation_bytes("predict", "fp32") < compensation_bytes("predict-spike", "fp32")
            < compensation_bytes("predict-nesterov", "fp32"))


def test_a_measured_compensation_survives_the_profile_file():
    profile = _measured(named_model("debug"), {"predict": 3e-9})
    data = json.loads(json.dumps(profile.to_dict()))
    assert profile_from_dict(data).compensation_s_per_param == {"predict": 3e-9}
    assert "compensation_s_per_param" not in _measured(named_model("debug")).to_dict()
    for bad in ({"nope": 1e-9}, {"predict": -1.0}):
        with pytest.raises(PlanError, match="compensation_s_per_param"):
            profile_from_dict(dict(data, compensation_s_per_param=bad))


def test_measure_profile_times_the_compensation_beyond_the_step():
    from dataclasses import replace

    from megatron_2bw.planner import measure_profile
    tiny = replace(named_model("debug"), num_layers=1, hidden_size=32, num_attention_heads=2,
                   seq_length=8, vocab_size=64)
    prof = measure_profile(tiny, (1,), repeats=1, compensation="predict")
    print("predict:", prof.compensation_s_per_param, "step:", prof.step_s_per_param)
    assert set(prof.compensation_s_per_param) == {"predict"}
    assert prof.compensation_s_per_param["predict"] >= 0
