"""Issue 30: the planner on the paper's case (PipeDream-2BW, ICML 2021: 8 x 8 V100-16GB, one
shared 25 Gbit/s NIC per server): sequence-parallel pricing, the microbatch-size efficiency
curve, GPipe's memory, shared NICs, the search's work."""
import pytest

from megatron_2bw.models.flops import DTYPE_BYTES, named_model
from megatron_2bw.planner import AnalyticProfile, Topology
from megatron_2bw.planner.cost_model import LayerTimes, Setup


@pytest.mark.parametrize("sp", [False, True])
def test_sequence_parallel_collectives_are_priced_at_the_full_activation(sp):
    """All-gather + reduce-scatter move what the all-reduce moved: the whole b*s*h activation,
    not the 1/t chunk a sequence-parallel stage boundary sends (the bug priced it at 1/t)."""
    model = named_model("gpt-3.8b")
    topo = Topology(num_nodes=8, gpus_per_node=8, gpu_memory_gb=16)
    prof = AnalyticProfile()
    times = LayerTimes(Setup(model, "fp16"), prof, topo)
    b, t = 64, 8
    costs, fwd, bwd = times.get(b, t, sp)
    layer = costs[1]
    full = DTYPE_BYTES["fp16"] * b * model.seq_length * model.hidden_size
    assert layer.output_bytes == pytest.approx(full / (t if sp else 1))  # the boundary message
    one = topo.ring_time(full, t, False)
    compute_f, compute_b = prof.layer_times(layer, b, t)
    print(f"sp={sp}: tensor-parallel comm per layer and pass {2 * one * 1e3:.3f} ms")
    assert fwd[1] - compute_f == pytest.approx(2 * one)
    assert bwd[1] - compute_b == pytest.approx(2 * one)
