"""The memory check before any process group: the planner's per-stage estimate (tested against the
engine's real buffers in test_planner_engine.py) against the free memory of the device the ranks
share; one line when it cannot fit."""
import pytest

from megatron_2bw.config import BatchConfig, Config, ModelConfig, ParallelConfig
from megatron_2bw.models.families import model_parts
from megatron_2bw.planner import AnalyticProfile, Topology
from megatron_2bw.planner.cost_model import LayerTimes, Layout, Setup, stage_plan
from megatron_2bw.planner.memory_check import (DeviceMemory, MemoryCheckError, check_memory,
                                               host_available_bytes, local_world_size,
                                               stage_estimates)

GB = 2 ** 30


def tiny(hidden=32, schedule="2bw", d=2, t=1, w=1, vocab=512, **model):
    cfg = Config(model=ModelConfig(num_layers=4, hidden_size=hidden, num_attention_heads=2,
                                   seq_length=16, vocab_size=vocab, **model),
                 parallel=ParallelConfig(tensor=t, pipeline=d, data=w),
                 batch=BatchConfig(micro_batch_size=2, global_batch_size=8 * w),
                 schedule=schedule)
    return cfg.validate(t * d * w)


@pytest.mark.parametrize("schedule", ["2bw", "flush", "gpipe"])
def test_estimate_is_the_planners_stage_memory_for_the_engines_partition(schedule):
    cfg = tiny(schedule=schedule, d=2)
    setup = Setup(cfg.model, cfg.precision.dtype, cfg.optimizer.name)
    layout = Layout(schedule, 1, 2, 1, 2, cfg.num_microbatches)
    topo = Topology()
    plan = stage_plan(setup, layout, LayerTimes(setup, AnalyticProfile(), topo), topo,
                      bounds=model_parts(cfg, num_stages=2)[2])
    assert stage_estimates(cfg, 2) == plan.memory


def test_fits_returns_the_bytes_of_the_ranks_sharing_the_memory():
    cfg = tiny()
    est = [s["total"] for s in stage_estimates(cfg, 2)]
    host = DeviceMemory("host memory", 10 * GB)
    assert check_memory(cfg, 2, rank=0, local_rank=0, memory=host, local_ranks=1) == int(est[0])
    assert check_memory(cfg, 2, rank=1, local_rank=1, memory=host, local_ranks=2) == \
        int(est[0] + est[1])
    assert check_memory(cfg, 2, memory=DeviceMemory("host memory", None)) == 0  # unknown: skip


def test_refusal_is_one_line_with_the_estimate_the_free_memory_and_the_fixes():
    cfg = tiny(hidden=4096)
    est = stage_estimates(cfg, 2)
    with pytest.raises(MemoryCheckError) as e:
        check_memory(cfg, 2, memory=DeviceMemory("host memory", 2 * GB), local_ranks=2)
    msg = str(e.value)
    assert "\n" not in msg
    for word in (f"about {est[0]['total'] / GB:.1f} GB per rank on pipeline stage 0",
                 "weights", "gradients", "optimizer state",
                 f"the 2 ranks sharing host memory {(est[0]['total'] + est[1]['total']) / GB:.1f}"
                 " GB together", "host memory has 2.0 GB free",
                 "--pipeline-model-parallel-size", "--tensor-model-parallel-size", "--auto-plan",
                 "--no-memory-check"):
        assert word in msg, f"{word!r} not in {msg!r}"


def test_activation_heavy_layouts_are_pointed_at_recomputation():
    cfg = tiny(hidden=64, schedule="gpipe").replace(
        batch={"micro_batch_size": 256, "global_batch_size": 4096},
        model={"seq_length": 1024, "max_position_embeddings": 1024})
    mem = stage_estimates(cfg, 2)[0]
    assert mem["activations"] > mem["total"] / 2
    with pytest.raises(MemoryCheckError, match="--recompute-activations \\(selective\\)"):
        check_memory(cfg, 2, memory=DeviceMemory("host memory", int(mem["total"] / 2)))


def test_on_gpus_only_the_local_ranks_on_the_same_gpu_share_it():
    cfg = tiny(d=2, w=2)  # ranks 0-3; tp-dp-pp: stage = rank // 2
    est = [s["total"] for s in stage_estimates(cfg, 4)]
    gpu = DeviceMemory("GPU 1", 10 * GB, gpu=1, gpus=2)
    # 4 local ranks on 2 GPUs: GPU 1 holds local ranks 1 and 3 (stages 0 and 1)
    assert check_memory(cfg, 4, rank=1, local_rank=1, memory=gpu, local_ranks=4) == \
        int(est[0] + est[1])
    one_each = DeviceMemory("GPU 1", 10 * GB, gpu=1, gpus=4)
    assert check_memory(cfg, 4, rank=1, local_rank=1, memory=one_each, local_ranks=4) == \
        int(est[0])


def test_launcher_and_host_values():
    assert local_world_size({"LOCAL_WORLD_SIZE": "4"}) == 4
    assert local_world_size({"SLURM_NTASKS_PER_NODE": "8(x2)"}) == 8
    assert local_world_size({}) is None
    free = host_available_bytes()
    assert free is None or free > 0


def test_the_readme_main_job_fits_here():
    cfg = tiny(hidden=64).replace(
        model={"num_attention_heads": 4, "seq_length": 32, "vocab_size": 2048},
        batch={"micro_batch_size": 4, "global_batch_size": 32})
    assert 0 < check_memory(cfg.validate(2), 2, local_ranks=2) < 100 * 2 ** 20


def test_nccl_runs_measure_the_local_ranks_gpu(monkeypatch):
    """The CUDA branch without a GPU: torch.cuda's answers stubbed by the test."""
    import torch
    from megatron_2bw.planner.memory_check import device_memory
    asked = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "mem_get_info",
                        lambda i: asked.append(i) or (3 * GB + i, 80 * GB))
    cfg = tiny().replace(**{"parallel.backend": "nccl"})
    assert device_memory(cfg, local_rank=3) == DeviceMemory("GPU 1", 3 * GB + 1, 1, 2)
    assert asked == [1]
    cfg = cfg.replace(**{"parallel.backend": "gloo"})
    assert device_memory(cfg, local_rank=3).name == "host memory"


def test_gpipe_over_memory_is_pointed_at_the_largest_flush_that_fits():
    """GPipe whose m stashes do not fit: the refusal names --gpipe-microbatches-per-flush K with
    the largest K that fits (K + 1 does not); no K fits: not offered; other schedules: never."""
    cfg = tiny(hidden=64, schedule="gpipe").replace(
        batch={"micro_batch_size": 8, "global_batch_size": 128},
        model={"seq_length": 256, "max_position_embeddings": 256})
    m = cfg.num_microbatches
    total = {k: stage_estimates(cfg.replace(microbatches_per_flush=k), 2)[0]["total"]
             for k in range(1, m + 1)}
    free = int((total[5] + total[6]) / 2)
    with pytest.raises(MemoryCheckError) as e:
        check_memory(cfg, 2, memory=DeviceMemory("host memory", free))
    assert "--gpipe-microbatches-per-flush 5 (the most microbatches in flight" in str(e.value)
    assert total[5] <= free < total[6] and "\n" not in str(e.value)
    with pytest.raises(MemoryCheckError) as e:
        check_memory(cfg, 2, memory=DeviceMemory("host memory", int(total[1] / 2)))
    assert "--gpipe-microbatches-per-flush" not in str(e.value)
    flush = cfg.replace(schedule="flush")
    with pytest.raises(MemoryCheckError) as e:
        check_memory(flush, 2, memory=DeviceMemory("host memory", 1 << 20))
    assert "--gpipe-microbatches-per-flush" not in str(e.value)
