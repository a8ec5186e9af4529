"""The memory the PipeDream-2BW paper's stack could use, from what the paper saw fit and not fit.

bench/paper_table.py predicts the paper's comparisons on its hardware; which layouts fit decides
several of them (above all GPipe's: "the maximum number of microbatches it can admit is small",
Sec. 5.2). A V100 has 16 GB, but how much of it the paper's stack (PyTorch and Megatron-LM of
2020: CUDA context, cuBLAS and NCCL buffers, the caching allocator's fragmentation) left to
weights and activations is not stated; the planner's default keeps 10% back. The paper does
report what fit on one server of 8 V100-16GB, (w, d) = (1, 8):

- Fig. 12a, GPT-1.3B, 2BW without recomputation: up to microbatch 4 ("tops out at microbatch 4
  due to OOM");
- Fig. 12b, GPT-2.2B, the same: "only reaches microbatch 2 before OOM";
- Fig. 12, with recomputation: microbatch 16 for both models;
- Sec. 5.3 and App. B.1, GPT-2.2B, GPipe with recomputation: "runs out of memory at a batch size
  of 64 ... (for GPT, only a batch size of 32 fits in memory)", at the panel's microbatch 8
  (B / (w d) = 64 / 8), all microbatches of the batch in flight;
- App. B.1, BERT-2.2B, the same: "GPipe does not run out of memory at the batch size of 64".

In this project's accounting (planner/memory.py: the engine's buffers, with the fp16 gradient
buffer the paper's Megatron-LM of 2020 keeps in each parameter's .grad until the step copies it
into the fp32 main gradient (its optimizer.py), `--grad-accumulation buffer`; attention keeping
its s x s scores, softmax and dropout mask, as that Megatron-LM did, two years before
FlashAttention) each observation bounds the usable memory: what fit needs at most that much,
what ran out more. `usable_interval` computes the bounds from the model (nothing here is a
number read off a result) and `calibrated_reserve` takes the middle of the interval.
"""
from __future__ import annotations

from dataclasses import replace

from megatron_2bw.models.flops import named_model
from megatron_2bw.planner.cost_model import LayerTimes, Layout, Setup, stage_plan
from megatron_2bw.planner.profile import AnalyticProfile
from megatron_2bw.planner.topology import GB, Topology

GPU_MEMORY_GB = 16
SERVER = dict(num_nodes=1, gpus_per_node=8, gpu_memory_gb=GPU_MEMORY_GB,
              intra_node_bandwidth_gbps=1200)
# The paper's throughput experiments run GPT at sequence length 512 (Sec. 5.2: the throughputs
# "using 8 and 64 V100s with a sequence length of 512"); config/flavours.py's GPT shapes carry
# 2048, the GPT-3 convention. Activations and the logits (s x V per sample) scale with it.
PAPER_SEQ_LENGTH = 512
# the paper's code (github.com/msr-fiddle/pipedream, megatron/): fp16 gradient all-reduce, an
# fp16 gradient per parameter beside the fp32 main one, attention without FlashAttention
GRAD_REDUCE_BYTES = 2.0
FLASH = False
GRAD_ACCUMULATION = "buffer"

# (what, model, schedule, recomputation, microbatch, microbatches, fit)
OBSERVED = (
    ("Fig. 12a: GPT-1.3B 2BW, no recomputation, b=4 fits", "gpt-1.3b", "2bw", False, 4, 8, True),
    ("Fig. 12a: GPT-1.3B 2BW, no recomputation, b=8 OOM", "gpt-1.3b", "2bw", False, 8, 8, False),
    ("Fig. 12b: GPT-2.2B 2BW, no recomputation, b=2 fits", "gpt-2.2b", "2bw", False, 2, 8, True),
    ("Fig. 12b: GPT-2.2B 2BW, no recomputation, b=4 OOM", "gpt-2.2b", "2bw", False, 4, 8, False),
    ("Fig. 12a: GPT-1.3B 2BW, recomputation, b=16 fits", "gpt-1.3b", "2bw", True, 16, 8, True),
    ("Fig. 12b: GPT-2.2B 2BW, recomputation, b=16 fits", "gpt-2.2b", "2bw", True, 16, 8, True),
    ("App. B.1: GPT-2.2B GPipe, batch 32 fits", "gpt-2.2b", "gpipe", True, 8, 4, True),
    ("Sec. 5.3: GPT-2.2B GPipe, batch 64 OOM", "gpt-2.2b", "gpipe", True, 8, 8, False),
    ("App. B.1: BERT-2.2B GPipe, batch 64 fits", "bert-2.2b", "gpipe", True, 8, 8, True),
)


def paper_model(name: str):
    """The named model at the paper's sequence length (GPT; BERT keeps its 512)."""
    model = named_model(name)
    if name.startswith("gpt"):
        model = replace(model, seq_length=PAPER_SEQ_LENGTH, max_position_embeddings=None)
    return model


def observed_memory() -> list:
    """[(what, fit, GiB the stage at its peak needs in this accounting)] for `OBSERVED`."""
    topo, profile = Topology(**SERVER), AnalyticProfile.for_device("v100")
    out = []
    for what, name, schedule, rc, b, m, fit in OBSERVED:
        setup = Setup(paper_model(name), "fp16", arch=name.split("-")[0],
                      grad_reduce_bytes=GRAD_REDUCE_BYTES, flash=FLASH,
                      grad_accumulation=GRAD_ACCUMULATION)
        plan = stage_plan(setup, Layout(schedule, 1, 8, 1, b, m, recompute=rc),
                          LayerTimes(setup, profile, topo), topo)
        out.append((what, fit, plan.max_memory / GB))
    return out


def usable_interval() -> tuple:
    """(lo, hi) GiB: the most any fitting observation needs, the least any OOM one needs (an
    empty interval, lo >= hi, would say the accounting cannot agree with the paper)."""
    seen = observed_memory()
    return (max(gib for _, fit, gib in seen if fit), min(gib for _, fit, gib in seen if not fit))


def calibrated_reserve() -> float:
    """Topology.memory_reserve_fraction at the middle of `usable_interval`."""
    lo, hi = usable_interval()
    return reserve_at((lo + hi) / 2)


def reserve_at(usable_gib: float) -> float:
    """Topology.memory_reserve_fraction that leaves `usable_gib` of the V100's 16 GiB."""
    return 1.0 - usable_gib / GPU_MEMORY_GB
