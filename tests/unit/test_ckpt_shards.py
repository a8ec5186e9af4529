"""The boxes of global tensors (checkpoint/dist/shards.py), no processes: a flat range of a tensor
is a few contiguous boxes, and a state in pieces of flat ranges (the distributed optimizer's
state_dict, issue 17: fp32 masters and Adam moments) saves as more chunks of the same global tensors
and reads back into any other split, or whole into a run without one."""
import math
import random
from types import SimpleNamespace

import pytest
import torch

from megatron_2bw.checkpoint.dist.load import read_full, stage_boxes
from megatron_2bw.checkpoint.dist.save import DistSave, nested_tensors, tmp_dir
from megatron_2bw.checkpoint.dist.shards import empty_state, flat_range_boxes, state_shards
from megatron_2bw.checkpoint.dist.storage import plan_save, read_boxes
from megatron_2bw.parallel.comm import Comm
from megatron_2bw.pipeline.faults import NO_FAULTS
from megatron_2bw.tensor_parallel.layers import shard_box
from megatron_2bw.training.build import mock_batches
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


def _pieces(state: dict, ranges: list, rank: int) -> dict:
    """The pieces form of a distributed optimizer's state (checkpoint/dist/shards.py) for `ranges`
    of the flat layout, its fp32 masters the newest weights."""
    opt = state["optimizer"]
    return {"sharded": {"count": 3, "rank": rank}, "steps": opt["steps"],
            "pieces": [{"range": (lo, hi), "exp_avg": opt["exp_avg"][lo:hi],
                        "exp_avg_sq": opt["exp_avg_sq"][lo:hi],
                        "master": state["newest"][lo:hi]} for lo, hi in ranges]}


def test_a_distributed_optimizer_state_in_pieces_saves_and_reads_into_any_split(tmp_path):
    engine, cfg, grid = _one_rank()
    engine.train_batch(mock_batches(cfg, 1, 0))
    view, numel = stage_boxes(engine, cfg, grid), engine.weights.numel
    state = engine.state_dict()
    a, b, c = numel // 3 + 7, numel // 2 + 1, 2 * numel // 3 + 5  # inside parameters: mid-row
    split = [[(0, a)], [(a, b), (c, numel)], [(b, c)]]  # 3 replicas, at most two pieces each
    shards = []
    for rank, ranges in enumerate(split):
        boxes, other = state_shards({"newest": state["newest"], "optimizer": _pieces(
            state, ranges, rank)}, view.params, numel)
        assert other == {"steps": state["optimizer"]["steps"]}, "rank's place is not state"
        assert sum(s.tensor.numel() for s in boxes if s.name.startswith("model.")) == \
            sum(hi - lo for lo, hi in ranges), "the masters replace the newest weights"
        shards += boxes
    directory = _save(shards, {}, str(tmp_path))
    whole = engine.weights.named_tensors(state["optimizer"]["exp_avg"])
    saved = read_full(directory, "optimizer.exp_avg.")
    assert set(saved) == {p.name for p in view.params}
    for name, value in whole.items():
        assert torch.equal(saved[name], value), name
    for n, v in engine.weights.named_tensors(state["newest"]).items():
        assert torch.equal(read_full(directory, "model.")[n], v), n

    def load(optimizer_state):
        buffers = empty_state(numel, None, optimizer_state)
        for t in [buffers["newest"], *nested_tensors(buffers["optimizer"])]:
            t.fill_(float("nan"))
        read_boxes(directory, state_shards(buffers, view.params, numel, reading=True)[0], [])
        return buffers

    flat = load(state["optimizer"])  # into a run without the distributed optimizer
    assert torch.equal(flat["newest"], state["newest"])
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(flat["optimizer"][key], state["optimizer"][key])
    other = [(numel // 4, numel - 3), (1, 2)]  # another split reads its pieces back, bitwise
    split2 = load(_pieces(state, other, 1))
    assert split2["optimizer"]["sharded"] == {"count": 3, "rank": 1}, "the loading rank's place"
    assert torch.equal(split2["newest"], state["newest"])
    for (lo, hi), piece in zip(other, split2["optimizer"]["pieces"]):
        assert piece["range"] == (lo, hi)
        assert torch.equal(piece["master"], state["newest"][lo:hi])
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(piece[key], state["optimizer"][key][lo:hi]), key
