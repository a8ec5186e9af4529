"""GEMM efficiency by matrix size: the built-in device curves and the fit of a measured profile.

A layer's GEMMs have M = b*s rows (the microbatch's tokens); their rate is the plateau times
M / (M + M_half): small microbatches pay a fixed cost (the weights' memory traffic, kernel
launches) that large ones amortize. The curve is monotone in M by construction. A measured
profile's times fit t(b) = alpha + beta*b, which is the same curve with M_half = alpha/beta * s.
"""
from __future__ import annotations

# Built-in GEMM-efficiency curves: peak dense fp16/bf16 TFLOP/s and HBM bandwidth from the
# vendor datasheets; `efficiency` is the plateau (large GEMMs, whole training step) and
# `gemm_half_tokens` the GEMM rows M at which half of it is reached.
DEVICES = {
    # V100-SXM2: 125 TFLOP/s fp16, 900 GB/s (NVIDIA Tesla V100 datasheet). Plateau 45 TFLOP/s:
    # the PipeDream-2BW paper's measured per-GPU rate (Narayanan et al., ICML 2021, Sec. 5, as
    # issue 30 quotes it). Shape: the paper's Fig. 12, ~4x throughput from b=1 to b=16 for its GPT
    # models, which its throughput experiments run at sequence length 512 (Sec. 5.2: "using 8 and
    # 64 V100s with a sequence length of 512"; not config/flavours.py's 2048, which an earlier
    # reading assumed): 16 (1 + k) / (16 + k) = 4 gives k = 4 samples, M_half = 4 x 512 rows
    # (kernel launch and framework overheads of small microbatches, not only the GEMMs).
    "v100": dict(device_tflops=125.0, efficiency=0.36, memory_bandwidth_gb_per_s=900.0,
                 gemm_half_tokens=4 * 512.0),
    # A100-SXM4-80GB: 312 TFLOP/s bf16, 2039 GB/s (NVIDIA A100 datasheet). Plateau 52% of peak:
    # Megatron-LM on 3072 A100s (Narayanan et al., SC 2021, abstract: "52% of theoretical peak").
    # M_half: the roofline's ridge in GEMM rows, peak x 2 bytes / (2 x bandwidth) (NVIDIA's
    # "Matrix Multiplication Background User's Guide", Math and Memory Bounds: a GEMM with small
    # M reads its K x N weights at ~2M/2 FLOP per byte, memory bound below ops:byte = peak / BW).
    "a100": dict(device_tflops=312.0, efficiency=0.52, memory_bandwidth_gb_per_s=2039.0,
                 gemm_half_tokens=312e12 / 2039e9),
    # H100-SXM5: 989 TFLOP/s bf16 dense, 3350 GB/s (NVIDIA H100 datasheet). Plateau 47% MFU:
    # Megatron-Core's README ("up to 47% Model FLOP Utilization on H100"). M_half: ridge as above.
    "h100": dict(device_tflops=989.0, efficiency=0.47, memory_bandwidth_gb_per_s=3350.0,
                 gemm_half_tokens=989e12 / 3350e9),
    # H200: the H100's compute (989 TFLOP/s bf16 dense) with 4800 GB/s HBM3e (NVIDIA H200
    # datasheet); same SMs, so the H100's 47% plateau; M_half: ridge as above.
    "h200": dict(device_tflops=989.0, efficiency=0.47, memory_bandwidth_gb_per_s=4800.0,
                 gemm_half_tokens=989e12 / 4800e9),
}


def gemm_efficiency(tokens: float, half_tokens: float) -> float:
    """Fraction of the plateau rate a GEMM of `tokens` rows reaches (1 without a curve)."""
    return tokens / (tokens + half_tokens) if half_tokens > 0 and tokens > 0 else 1.0


def ridge_tokens(device_tflops: float, memory_bandwidth_gb_per_s: float) -> float:
    """GEMM rows below which reading the weights bounds a GEMM: peak x 2 bytes / (2 x
    bandwidth), the roofline's ridge (the A100/H100/H200 curves' M_half)."""
    return device_tflops * 1e12 / (memory_bandwidth_gb_per_s * 1e9)


def fixed_cost_split(half_tokens: float, ridge: float, tensor: int) -> float:
    """The curve's fixed cost per microbatch (M_half rows' worth of the layer) as rows of one
    tensor-parallel rank's share: t(b) = F/P (1 + M_half/M) splits M_half into the weights'
    memory traffic (up to the ridge), which t ranks share like the FLOPs (each reads 1/t of the
    weights), and the rest, work per microbatch that does not shrink with a rank's slice (kernel
    launches, framework and pipeline work, as the V100 curve's source lumps them), which every
    rank pays in full (t times its share of the layer; checked against Megatron-LM's measured
    strong scaling: tests/unit/test_planner_tensor_scaling.py). 1 / t of every rank's
    share without tensor parallelism: M_half unchanged."""
    weights = min(half_tokens, ridge)
    return weights + (half_tokens - weights) * tensor


def fit_gemm_curve(points) -> tuple:
    """(alpha, beta) of t(b) = alpha + beta * b fitted by least squares to [(b, seconds)], alpha
    clamped to >= 0 (a curve that only rises); M_half = alpha / beta * s rows."""
    pts = sorted((float(b), float(t)) for b, t in points)
    if len(pts) == 1 or pts[0][0] == pts[-1][0]:
        return 0.0, pts[-1][1] / pts[-1][0]
    n = len(pts)
    mb, mt = sum(b for b, _ in pts) / n, sum(t for _, t in pts) / n
    var = sum((b - mb) ** 2 for b, _ in pts)
    beta = sum((b - mb) * (t - mt) for b, t in pts) / var
    alpha = mt - beta * mb
    if alpha < 0 or beta <= 0:  # faster than proportional: no fixed cost to amortize
        return 0.0, sum(t for _, t in pts) / sum(b for b, _ in pts)
    return alpha, beta


__all__ = ["DEVICES", "gemm_efficiency", "fit_gemm_curve", "fixed_cost_split", "ridge_tokens"]
