"""Blending several datasets by weight (`--data-path 0.3 A 0.7 B`), Megatron's way.

Sample i of the blend comes from the dataset whose share is furthest behind its weight at i
(a deterministic low-discrepancy interleave: after any n samples each dataset has supplied
within one sample of weight x n). The two indices are cached like the GPT indices.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from megatron_2bw.data.cache import cached_arrays
from megatron_2bw.data.errors import DataError


def parse_data_path(data_path: list[str] | str) -> tuple[list[str], list[float] | None]:
    """['0.3', 'A', '0.7', 'B'] -> (['A', 'B'], [0.3, 0.7]); ['A', 'B'] -> (['A', 'B'], None)."""
    items = data_path.split() if isinstance(data_path, str) else [str(x) for x in data_path]
    if not items:
        raise DataError("--data-path: give PREFIX, or weights and prefixes: --data-path 0.3 A "
                        "0.7 B")
    if len(items) == 1:
        return items, None

    def is_number(s):
        try:
            float(s)
            return True
        except ValueError:
            return False

    if not any(is_number(s) for s in items):
        return items, None
    if len(items) % 2 or not all(is_number(s) for s in items[::2]):
        raise DataError(f"--data-path {' '.join(items)}: weights and prefixes must alternate "
                        "(WEIGHT PREFIX WEIGHT PREFIX ...), e.g. --data-path 0.3 A 0.7 B")
    weights, prefixes = [float(s) for s in items[::2]], items[1::2]
    if any(w < 0 or not math.isfinite(w) for w in weights) or sum(weights) <= 0:
        raise DataError(f"--data-path: weights {weights} must be non-negative with a positive sum")
    return prefixes, weights


def normalize(weights: list[float]) -> list[float]:
    total = sum(weights)
    return [w / total for w in weights]


def samples_per_dataset(weights: list[float], num_samples: int) -> list[int]:
    """Each dataset is built 0.5% larger than its share, as Megatron does, so that the blend
    never runs off the end of one."""
    return [int(math.ceil(w * num_samples * 1.005)) for w in normalize(weights)]


def build_blending_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's helpers.build_blending_indices: (dataset of sample i, its index there)."""
    w = normalize(weights)
    k = len(w)
    dataset_index = np.empty(size, dtype=np.int16)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    counts = [0] * k
    for i in range(size):
        t = max(float(i), 1.0)
        best, best_err = 0, w[0] * t - counts[0]
        for d in range(1, k):
            err = w[d] * t - counts[d]
            if err > best_err:
                best, best_err = d, err
        dataset_index[i] = best
        dataset_sample_index[i] = counts[best]
        counts[best] += 1
    return dataset_index, dataset_sample_index


class BlendedDataset:
    """`size` samples drawn from `datasets` by `weights` (any objects with __getitem__)."""

    def __init__(self, datasets: list, weights: list[float], size: int, cache_dir: str | Path):
        if len(datasets) != len(weights) or not datasets:
            raise DataError("--data-path: one weight per prefix is needed")
        self.datasets, self.weights, self.size = datasets, normalize(weights), size
        self.description = {"class": "BlendedDataset", "weights": self.weights, "size": size,
                            "datasets": [getattr(d, "description", repr(d)) for d in datasets]}
        arrays, self.built_indices = cached_arrays(
            Path(cache_dir), self.description, ("dataset_index", "dataset_sample_index"),
            lambda: dict(zip(("dataset_index", "dataset_sample_index"),
                             build_blending_indices(self.weights, size))))
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        for d, n in enumerate(np.bincount(self.dataset_index, minlength=len(datasets))):
            if n > len(datasets[d]):
                raise DataError(f"--data-path: blend needs {n} samples of dataset {d} but it "
                                f"has {len(datasets[d])}: build it with more samples")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int):
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} out of range: the blend has {self.size} samples")
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]
