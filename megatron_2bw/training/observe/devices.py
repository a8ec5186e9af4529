"""Peak dense bf16 tensor throughput of known accelerators, for model-FLOPs utilization (MFU).

    peak_tflops("NVIDIA H200")   # 989.0
    peak_tflops("Tesla V100")    # None: unknown or no bf16 (pass --peak-tflops)

Keyed by substrings of `torch.cuda.get_device_name()`, the most specific first (vendor data
sheets, dense: without 2:4 sparsity).
"""
from __future__ import annotations

PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),       # SXM
    ("H800", 989.0),
    ("H20", 148.0),
    ("B200", 2250.0),
    ("B100", 1750.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("A30", 165.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("A10", 125.0),
    ("RTX 4090", 165.0),
    ("MI300X", 1307.0),
    ("MI250X", 383.0),
)


def peak_tflops(device_name: str) -> float | None:
    """Peak dense bf16 TFLOP/s of the named device, or None when it is not in the table."""
    for key, value in PEAK_BF16_TFLOPS:
        if key.lower() in device_name.lower():
            return value
    return None
