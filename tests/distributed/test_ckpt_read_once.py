"""Loading at scale (issue 29, point 4), on two gloo ranks that are data-parallel replicas
(t=1, d=1, w=2), so they read the same files:

- every file of a checkpoint is hashed once in the job, by one of the ranks that read it
  (counted by wrapping `checkpoint.files.sha256_of` in each process), in both formats;
- a truncated torch-format stage file is one line on every rank (naming the file and the
  fix), never torch's zip traceback: it is hashed before anything unpickles it;
- ranks that see different `latest` files (a node-local or stale view) stop with one line.
"""
import collections
import os

import pytest
import torch

from megatron_2bw.checkpoint import files
from megatron_2bw.checkpoint.api import load_checkpoint, save_checkpoint
from megatron_2bw.checkpoint.files import LATEST, CheckpointError
from megatron_2bw.config.build import build_config
from megatron_2bw.parallel.grid import ProcessGrid
from megatron_2bw.pretrain import build_parser
from megatron_2bw.training.build import build_engine, mock_batches
from megatron_2bw.training.spawn import spawn

TINY = ("--mock-data --num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
        "--micro-batch-size 1 --global-batch-size 4 --vocab-size 64 --train-iters 4").split()
FORMATS = ("torch_dist", "torch")
STAGE_FILE = os.path.join("iter_0000001", "mp_rank_00", "model_optim_rng.pt")


def _error(call) -> str | None:
    try:
        call()
    except CheckpointError as e:
        return str(e)
    return None


def _counted_load(root, cfg, grid):
    """load_checkpoint into a fresh engine; (iteration, the files this process hashed)."""
    hashed, real = [], files.sha256_of

    def counting(path):
        hashed.append(os.path.relpath(path, root))
        return real(path)
    files._DIGESTS.clear()  # this process's cache of digests: start cold
    files.sha256_of = counting
    try:
        it = load_checkpoint(root, build_engine(cfg, grid, "cpu"), cfg, grid)
    finally:
        files.sha256_of = real
    return it, hashed


def _worker(rank, world, root, out):
    results = {}
    for fmt in FORMATS:
        argv = TINY + ["--ckpt-format", fmt]
        cfg = build_config(build_parser("gpt").parse_args(argv), "gpt", world).config
        grid = ProcessGrid.from_config(cfg, rank, world).init_groups()
        engine = build_engine(cfg, grid, "cpu")
        engine.train_batch(mock_batches(cfg, grid.data, grid.dp_rank))
        ck = os.path.join(root, fmt)
        save_checkpoint(ck, engine, cfg, grid)
        results[fmt] = _counted_load(ck, cfg, grid)
    stage = os.path.join(root, "torch", STAGE_FILE)
    if rank == 0:
        with open(stage, "r+b") as f:  # noqa: the test damages a checkpoint on purpose
            f.truncate(os.path.getsize(stage) // 2)
    grid.comm.barrier()
    results["truncated"] = _error(lambda: load_checkpoint(
        os.path.join(root, "torch"), build_engine(cfg, grid, "cpu"), cfg, grid))
    # each rank its own view of `latest`: rank 1's is stale, or missing
    for case, mine in (("stale", 4 if rank == 0 else 2), ("missing", 4 if rank == 0 else None)):
        view = os.path.join(root, f"{case}{rank}")
        for it in (2, 4):
            os.makedirs(os.path.join(view, f"iter_{it:07d}"))
        if mine is not None:
            with open(os.path.join(view, LATEST), "w") as f:  # noqa: a test fixture
                f.write(f"{mine}\n")
        results[case] = _error(lambda: load_checkpoint(view, None, cfg, grid))
    torch.save(results, f"{out}.{rank}")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    d = tmp_path_factory.mktemp("read_once")
    spawn(_worker, 2, args=(str(d / "ck"), str(d / "out")), timeout_minutes=2)
    return d / "ck", [torch.load(f"{d / 'out'}.{r}", weights_only=False) for r in range(2)]


def test_every_file_is_hashed_once_in_the_job_by_one_reader(ranks):
    root, results = ranks
    directory = root / "torch_dist" / "iter_0000001"
    for fmt in FORMATS:
        assert [r[fmt][0] for r in results] == [1, 1]
        counts = collections.Counter(p for r in results for p in r[fmt][1])
        assert set(counts.values()) == {1}, (fmt, counts)
    hashed = {os.path.basename(p) for r in results for p in r["torch_dist"][1]}
    assert hashed == set(os.listdir(directory)) - {"checksums.sha256"}
    assert all(r["torch_dist"][1] for r in results), "the hashing is spread over the readers"
    assert [p for r in results for p in r["torch"][1]] == [STAGE_FILE]


def test_a_truncated_stage_file_is_one_line_on_every_rank(ranks):
    root, results = ranks
    path = root / "torch" / STAGE_FILE
    assert [r["truncated"] for r in results] == [
        f"checkpoint file {path} does not match its checksum: it is truncated or corrupted; "
        "load an earlier iteration"] * 2


def test_ranks_that_see_different_latest_stop_with_one_line(ranks):
    root, results = ranks
    for case, theirs in (("stale", "iteration 2"), ("missing", f"no {LATEST}")):
        for rank, r in enumerate(results):
            mine = "iteration 4" if rank == 0 else theirs
            assert r[case] == (
                f"the ranks see different {LATEST} in {root / f'{case}{rank}'}: {theirs} on "
                f"some, iteration 4 on others (this rank: {mine}): a node-local or stale view "
                "of the filesystem; pass --load a directory on a filesystem every node sees "
                "alike"), (case, rank)
