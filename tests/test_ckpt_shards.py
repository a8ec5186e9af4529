"""The boxes of global tensors (ckpt/shards.py), no processes: a flat range of a tensor is a few
contiguous boxes, and a state sharded by flat ranges (how a distributed optimizer holds its
buffers, issue 17) saves as more chunks of the same global tensors and reads back into any other
split or whole."""
import math
import random
from types import SimpleNamespace

import pytest
import torch

from megatron_2bw.ckpt.load import read_full, stage_boxes
from megatron_2bw.ckpt.save import DistSave, tmp_dir
from megatron_2bw.ckpt.shards import flat_range_boxes, flat_shards, state_shards
from megatron_2bw.ckpt.storage import plan_save, read_boxes
from megatron_2bw.parallel.comm import Comm
from megatron_2bw.reliability import NO_FAULTS
from megatron_2bw.tensor_parallel.layers import shard_box
from megatron_2bw.training import mock_batches
from test_ckpt_async import _one_rank


@pytest.mark.parametrize("shape", [(7,), (3, 5), (4, 3, 6), (2, 3, 4, 5), (1, 1, 9)])
def test_a_flat_range_is_at_most_2k_minus_1_contiguous_boxes_in_order(shape):
    full = torch.arange(math.prod(shape)).view(shape)
    rng = random.Random(len(shape))
    ranges = [(0, full.numel()), (0, 1), (full.numel() - 1, full.numel())]
    ranges += [tuple(sorted(rng.sample(range(full.numel() + 1), 2))) for _ in range(40)]
    for lo, hi in ranges:
        boxes = flat_range_boxes(shape, lo, hi)
        assert len(boxes) <= 2 * len(shape) - 1
        got = [full[tuple(slice(o, o + s) for o, s in zip(off, size))].reshape(-1)
               for off, size in boxes]
        for g in got:
            assert torch.equal(g, torch.arange(int(g[0]), int(g[0]) + g.numel()))  # contiguous
        assert torch.equal(torch.cat(got) if got else torch.zeros(0, dtype=torch.long),
                           torch.arange(lo, hi))


def test_shard_box_is_the_chunk_layout_of_the_tensor_parallel_layers():
    full = torch.arange(24.).view(4, 6)
    for dim in (0, 1):
        for r, chunk in enumerate(full.chunk(2, dim=dim)):
            shape, offsets = shard_box(chunk.shape, dim, r, 2)
            assert shape == (4, 6)
            index = tuple(slice(o, o + s) for o, s in zip(offsets, chunk.shape))
            assert torch.equal(full[index], chunk)
    assert shard_box((4, 6), None, 1, 2) == ((4, 6), (0, 0))


def _save(shards, objects, root, it=1):
    grid = SimpleNamespace(comm=Comm(), rank=0)
    planned = plan_save(shards, objects, tmp_dir(root, it), grid.comm)
    common = {"iteration": it}
    return DistSave(root, it, grid, planned, common, 0, NO_FAULTS).start(False).finish()


def test_a_state_sharded_by_flat_ranges_saves_and_reads_into_any_split(tmp_path):
    engine, cfg, grid = _one_rank()
    engine.train_batch(mock_batches(cfg, 1, 0))
    view, numel = stage_boxes(engine, cfg, grid), engine.weights.numel
    state = engine.state_dict()
    cut = numel // 2 + 7  # inside a parameter: its boxes split mid-row
    shards = state_shards({"newest": state["newest"]}, view.params, numel, 0, numel)[0]
    for lo, hi in ((0, cut), (cut, numel)):  # two "replicas" of a distributed optimizer
        part = {k: v[lo:hi] for k, v in state["optimizer"].items() if torch.is_tensor(v)}
        boxes, other = state_shards({"optimizer": part}, view.params, numel, lo, hi)
        assert other == {}
        shards += boxes
    directory = _save(shards, {}, str(tmp_path))
    whole = engine.weights.named_tensors(state["optimizer"]["exp_avg"])
    saved = read_full(directory, "optimizer.exp_avg.")
    assert set(saved) == {p.name for p in view.params}
    for name, value in whole.items():
        assert torch.equal(saved[name], value), name
    lo, hi = numel // 3, numel - 5  # another split reads its range back, bitwise
    target = torch.full((hi - lo,), float("nan"))
    read_boxes(directory, flat_shards("optimizer.exp_avg_sq.", target, lo, view.params), [])
    assert torch.equal(target, state["optimizer"]["exp_avg_sq"][lo:hi])
