"""Blending several datasets (`--data-path 0.3 A 0.7 B`, or `A B` weighted by their sizes),
in megatron-core's order: the same per-component sample counts, dataset index and
dataset-sample index as its BlendedMegatronDatasetBuilder and BlendedDataset.

Sample i of the blend comes from the dataset whose share is furthest behind its weight at i
(a deterministic low-discrepancy interleave: after any n samples each dataset has supplied
within one sample of weight x n). `blend_split` sizes the components and the blend as Megatron
does (see its doc). The two indices are cached like the GPT indices.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from megatron_2bw.data.cache import cached_arrays
from megatron_2bw.data.errors import DataError


def parse_data_path(data_path: list[str] | str, flag: str = "--data-path"
                    ) -> tuple[list[str], list[float] | None]:
    """['0.3', 'A', '0.7', 'B'] -> (['A', 'B'], [0.3, 0.7]); ['A', 'B'] -> (['A', 'B'], None).
    `flag`: the flag the list came from (--data-path, --train-data-path, ...), for the errors."""
    items = data_path.split() if isinstance(data_path, str) else [str(x) for x in data_path]
    if not items:
        raise DataError(f"{flag}: give PREFIX, or weights and prefixes: {flag} 0.3 A 0.7 B")
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
        raise DataError(f"{flag} {' '.join(items)}: weights and prefixes must alternate "
                        f"(WEIGHT PREFIX WEIGHT PREFIX ...), e.g. {flag} 0.3 A 0.7 B")
    weights, prefixes = [float(s) for s in items[::2]], items[1::2]
    if any(w < 0 or not math.isfinite(w) for w in weights) or sum(weights) <= 0:
        raise DataError(f"{flag}: weights {weights} must be finite and non-negative with a "
                        "positive sum")
    return prefixes, weights


MID_LEVEL_SURPLUS = 0.005  # megatron-core's mid_level_dataset_surplus default


def normalize(weights: list[float]) -> list[float]:
    """megatron.core.datasets.utils.normalize: float64 weights / their numpy sum."""
    w = np.asarray(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def size_per_dataset(weights: list[float], size: int, surplus: float = 0.0) -> list[int]:
    """Megatron's _get_size_per_split_per_dataset for one split: component d is asked for
    ceil(ceil(size x w_d) x (1 + surplus)) samples. surplus 0: the samples the blend will use
    (their sum is the blend's size); MID_LEVEL_SURPLUS: the samples each component is built
    with, so that the greedy interleave never runs off the end of one."""
    return [int(math.ceil(math.ceil(size * w) * (1 + surplus))) for w in normalize(weights)]


def samples_per_dataset(weights: list[float], num_samples: int) -> list[int]:
    """The number of samples each component dataset is built with (Megatron's buffer)."""
    return size_per_dataset(weights, num_samples, MID_LEVEL_SURPLUS)


def _furthest_below(w: list[float], counts: list[int], t: float, candidates) -> int:
    """The candidate dataset whose count is furthest below its share w x t (ties: the first)."""
    best, best_err = -1, -math.inf
    for d in candidates:
        err = w[d] * t - counts[d]
        if err > best_err:
            best, best_err = d, err
    return best


def build_blending_indices(weights: list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's helpers.build_blending_indices: (dataset of sample i, its index there).
    Sample i goes to the dataset whose count is furthest below weight x max(i, 1) (ties: the
    first); the weights are normalized first, as BlendedDataset does."""
    w = normalize(weights)
    k = len(w)
    dataset_index = np.empty(size, dtype=np.int16)
    dataset_sample_index = np.empty(size, dtype=np.int64)
    counts, every = [0] * k, range(k)
    for i in range(size):
        best = _furthest_below(w, counts, max(float(i), 1.0), every)
        dataset_index[i] = best
        dataset_sample_index[i] = counts[best]
        counts[best] += 1
    return dataset_index, dataset_sample_index


def build_exhaustive_blending_indices(sizes: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's helpers.build_exhaustive_blending_indices: exactly sizes[d] samples of each
    dataset d, interleaved by the same greedy among the datasets not yet spent."""
    total = int(sum(sizes))
    w = [s / float(total) for s in sizes]
    dataset_index = np.empty(total, dtype=np.int16)
    dataset_sample_index = np.empty(total, dtype=np.int64)
    counts = [0] * len(sizes)
    unspent = [d for d in range(len(sizes)) if sizes[d] > 0]
    for i in range(total):
        best = _furthest_below(w, counts, max(float(i), 1.0), unspent)
        dataset_index[i] = best
        dataset_sample_index[i] = counts[best]
        counts[best] += 1
        if counts[best] == sizes[best]:
            unspent.remove(best)
    return dataset_index, dataset_sample_index


def blend_split(make_part, num_parts: int, weights: list[float] | None, size: int | None):
    """One split of megatron-core's BlendedMegatronDatasetBuilder (a blend from one
    distribution): (components, blend weights, blend size). `make_part(d, num_samples)`
    builds component d (num_samples None: one epoch).

    - weights given: component d is built with samples_per_dataset(...)[d] samples; the blend
      has sum(size_per_dataset(weights, size)) samples (a little over `size`).
    - no weights: one epoch of each component, weighted by its number of samples; the blend
      has min(size, their total) samples, or all of them (each exactly once) when size is None.
    """
    if weights is not None:
        if size is None:  # Megatron refuses this; we blend as far as the smallest share reaches
            parts = [make_part(d, None) for d in range(num_parts)]
            w = normalize(weights)
            return parts, weights, int(min(len(p) / x for p, x in zip(parts, w) if x > 0))
        parts = [make_part(d, n) for d, n in enumerate(samples_per_dataset(weights, size))]
        return parts, weights, sum(size_per_dataset(weights, size))
    parts = [make_part(d, None) for d in range(num_parts)]
    lengths = [len(p) for p in parts]
    return parts, lengths, None if size is None else min(size, sum(lengths))


class BlendedDataset:
    """`size` samples drawn from `datasets` by `weights` (any objects with __len__ and
    __getitem__), as megatron-core's BlendedDataset: size given, the greedy interleave by the
    normalized weights; size None, the weights are sample counts and each dataset gives exactly
    that many (the exhaustive interleave)."""

    def __init__(self, datasets: list, weights: list, size: int | None, cache_dir: str | Path,
                 builder: bool | None = None):
        if len(datasets) != len(weights) or not datasets:
            raise DataError("--data-path: one weight per prefix is needed")
        if size is None:
            weights = [int(w) for w in weights]
            size = sum(weights)
            build = lambda: build_exhaustive_blending_indices(weights)  # noqa: E731
        else:
            weights = normalize(weights)
            build = lambda: build_blending_indices(weights, size)  # noqa: E731
        self.datasets, self.weights, self.size = datasets, weights, size
        self.description = {"class": "BlendedDataset", "weights": self.weights, "size": size,
                            "datasets": [getattr(d, "description", repr(d)) for d in datasets]}
        arrays, self.built_indices = cached_arrays(
            Path(cache_dir), self.description, ("dataset_index", "dataset_sample_index"),
            lambda: dict(zip(("dataset_index", "dataset_sample_index"), build())),
            builder=builder)
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        for d, n in enumerate(np.bincount(self.dataset_index, minlength=len(datasets))):
            if n > len(datasets[d]):
                raise DataError(f"--data-path: the blend needs {n} samples of dataset {d} but "
                                f"it has {len(datasets[d])}: build it with more samples")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int):
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} out of range: the blend has {self.size} samples")
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]
