"""Cached index files built once per node by real processes: four ranks (one node, or a builder
per node on a shared filesystem) read the same arrays; helpers in tests/unit/test_data_cache.py."""
import multiprocessing

import pytest

from test_data_cache import _dataset_as_rank, _no_leftovers
from test_data_gpt import make_dataset


@pytest.mark.parametrize("builders_only", [False, True], ids=["one-node", "shared-fs-nodes"])
def test_processes_share_one_cache(tmp_path, builders_only):
    data = make_dataset(tmp_path / "d")
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        results = pool.starmap_async(
            _dataset_as_rank, [(r, data, tmp_path / "c", builders_only) for r in range(4)]
        ).get(timeout=600)  # a builder that failed would leave the waiters waiting
    built = [b for b, _ in results]
    if builders_only:  # a builder per (pretend) node: which ones build depends on timing
        assert any(built)
    else:
        assert built == [True, False, False, False]
    assert all(samples == results[0][1] for _, samples in results)
    assert len(list((tmp_path / "c").glob("*.npy"))) == 3
    assert _no_leftovers(tmp_path / "c")
    again = _dataset_as_rank(0, data, tmp_path / "c", False)  # a later run reuses the files
    assert again == (False, results[0][1])
