"""Tiny .bin/.idx datasets for the data tests."""
from pathlib import Path

import numpy as np

from megatron_2bw.data.indexed_dataset import IndexedDatasetBuilder


def write_documents(path: Path, low: int, num_docs: int = 12) -> str:
    """`num_docs` documents of 5-19 token ids in [low, low + 40) at PATH.bin/.idx (which prefix
    a sample came from shows in its ids); returns the prefix."""
    rng = np.random.RandomState(low)
    b = IndexedDatasetBuilder(f"{path}.bin", np.int32)
    for _ in range(num_docs):
        n = int(rng.randint(5, 20))
        b.add_document(low + rng.randint(0, 40, size=n), [n])
    b.finalize(f"{path}.idx")
    return str(path)
