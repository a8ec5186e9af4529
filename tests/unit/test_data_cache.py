"""Index caches without file locks: local rank 0 builds (unique temporary names, atomic renames),
the other ranks of the node wait for the files; concurrent builders (one per node on a shared
filesystem) are harmless; a waiter whose builder never comes fails with one line."""
import os
import threading
from pathlib import Path

import numpy as np
import pytest

from megatron_2bw.data import cache
from megatron_2bw.data.cache import cached_arrays, wait_until
from megatron_2bw.data.errors import DataError


def _dataset_as_rank(local_rank, data, cache_dir, builders_only):
    """One launcher-started process: torchrun's variables say who it is."""
    os.environ.update(RANK=str(local_rank), WORLD_SIZE="4", LOCAL_RANK=str(local_rank))
    if builders_only:
        os.environ["LOCAL_RANK"] = "0"  # every process the first on its (pretend) node
    from megatron_2bw.data.gpt_dataset import GPTDataset
    from megatron_2bw.data.indexed_dataset import MMapIndexedDataset
    ds = GPTDataset(MMapIndexedDataset(data), np.arange(50), 3000, 8, 5, cache_dir)
    return ds.built_indices, [ds[i].tolist() for i in range(0, len(ds), 97)]


def _no_leftovers(d: Path):
    return not [p.name for p in d.iterdir() if ".tmp-" in p.name]


def test_waiters_wait_for_the_builder(tmp_path):
    calls, out = [], []

    def build():
        calls.append(1)
        threading.Event().wait(0.3)  # the waiters arrive while it builds
        return {"a": np.arange(10)}

    def rank(builder):
        out.append(cached_arrays(tmp_path, {"class": "T", "k": 1}, ("a",), build,
                                 builder=builder, timeout_s=30))
    threads = [threading.Thread(target=rank, args=(b,)) for b in (False, True, False)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and sorted(built for _, built in out) == [False, False, True]
    assert all(arrays["a"].tolist() == list(range(10)) for arrays, _ in out)
    assert _no_leftovers(tmp_path)


def test_concurrent_builders_are_harmless(tmp_path):
    out = []

    def build():
        threading.Event().wait(0.3)  # everybody builds at once: no lock serializes them
        return {"a": np.arange(1000), "b": np.ones((3, 4))}

    def node():
        out.append(cached_arrays(tmp_path, {"class": "T"}, ("a", "b"), build, builder=True))
    threads = [threading.Thread(target=node) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [built for _, built in out] == [True] * 3
    assert all(a["a"].tolist() == list(range(1000)) and a["b"].sum() == 12 for a, _ in out)
    assert sorted(p.name.split("-", 2)[2] for p in tmp_path.iterdir()) == \
        ["a.npy", "b.npy", "description.json"]


def test_a_waiter_without_a_builder_fails_with_one_line(tmp_path):
    with pytest.raises(DataError) as e:
        cached_arrays(tmp_path, {"class": "T"}, ("a",), lambda: {"a": np.arange(3)},
                      builder=False, timeout_s=0.2)
    msg = str(e.value)
    assert "\n" not in msg and "description.json" in msg and "--data-cache-path" in msg


def test_wait_backs_off(tmp_path):
    sleeps = []
    with pytest.raises(DataError, match="not built after 0.5 s"):
        wait_until(lambda: False, tmp_path / "x", timeout_s=0.5,
                   sleep=lambda s: (sleeps.append(s), threading.Event().wait(s)))
    assert sleeps[:4] == [0.05, 0.1, 0.2, 0.4] and max(sleeps) <= 2.0


def test_local_rank_decides_the_builder(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS",
                "SLURM_LOCALID", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert cache.is_local_builder()  # a plain `python` run
    monkeypatch.setenv("SLURM_PROCID", "9")
    monkeypatch.setenv("SLURM_NTASKS", "16")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    assert not cache.is_local_builder()
    monkeypatch.setenv("SLURM_LOCALID", "0")
    assert cache.is_local_builder()


def test_a_failed_build_leaves_no_partial_files(tmp_path):
    def build():
        raise RuntimeError("disk full")
    with pytest.raises(RuntimeError, match="disk full"):
        cached_arrays(tmp_path, {"class": "T"}, ("a",), build, builder=True)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError):  # an array np.save cannot write: its temp file is removed
        cache.atomic_create_npy(tmp_path / "x.npy", np.array([object()]))
    assert list(tmp_path.iterdir()) == []


def test_a_second_builder_never_replaces_the_first_builders_files(tmp_path):
    """The publish race (issue 29): builder 2 checks the cache, finds it missing and builds;
    meanwhile builder 1 publishes and a reader opens its files. Builder 2's publish keeps
    builder 1's files (same inodes, still open by the reader), drops its own, and both end
    with valid caches."""
    description, names = {"class": "T", "k": 2}, ("a", "b")
    seen = {}

    def first_builder():
        arrays, built = cached_arrays(tmp_path, description, names,
                                      lambda: {"a": np.arange(6), "b": np.ones(3)}, builder=True)
        seen["reader"] = arrays  # memory-mapped: a reader of builder 1's files
        seen["inodes"] = {p.name: p.stat().st_ino for p in tmp_path.iterdir()}
        return built

    def second_build():  # builder 2 computes while builder 1 finishes and publishes
        assert first_builder()
        return {"a": np.arange(6), "b": np.ones(3)}

    arrays, built = cached_arrays(tmp_path, description, names, second_build, builder=True)
    assert built
    assert {p.name: p.stat().st_ino for p in tmp_path.iterdir()} == seen["inodes"]
    assert len(seen["inodes"]) == 3 and _no_leftovers(tmp_path)
    for a in (arrays, seen["reader"]):
        assert a["a"].tolist() == list(range(6)) and a["b"].tolist() == [1.0] * 3


def test_create_if_absent_publishes_once(tmp_path):
    from megatron_2bw import fs
    path = tmp_path / "x.bin"
    assert fs.atomic_create_bytes(path, b"first")
    inode = path.stat().st_ino
    assert not fs.atomic_create_bytes(path, b"second")
    assert path.read_bytes() == b"first" and path.stat().st_ino == inode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.bin"]


def test_create_if_absent_without_hard_links(tmp_path, monkeypatch):
    """A filesystem without hard links (EPERM): publish by rename, still never over a file."""
    import errno
    from megatron_2bw import fs

    def no_links(src, dst):
        raise OSError(errno.EPERM, "Operation not permitted")
    monkeypatch.setattr(fs.os, "link", no_links)
    path = tmp_path / "x.bin"
    assert fs.atomic_create_bytes(path, b"first")
    assert not fs.atomic_create_bytes(path, b"second")
    assert path.read_bytes() == b"first" and sorted(p.name for p in tmp_path.iterdir()) == ["x.bin"]
