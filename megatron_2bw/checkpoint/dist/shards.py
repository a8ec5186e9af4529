"""A stage's engine state as boxes of global tensors: the layout-free view that torch_dist
checkpoints store (package docstring: the files).

Every tensor of the state has a global name and a global shape, whatever (t, d, w), the schedule
or the optimizer's sharding:

    model.<name>               the newest weights W(t), fp32
    model_previous.<name>      2BW only: the version the next batch runs on, W(t-1) (model dtype)
    optimizer.<key>.<name>     each per-element optimizer buffer: exp_avg, exp_avg_sq (Adam),
                               momentum (SGD), last_grad (Adam keeping its latest gradient:
                               --2bw-compensation predict-nesterov; optional when loading,
                               load.py)

<name> is the parameter's name in the one-process model (`layers.<spec index>.<path>`, a tied
embedding once, under its first name: checkpoint/convert/native.py). A rank holds boxes (offsets,
sizes) of the tensors it owns:

- tensor parallelism: rank r's shard is the r-th equal chunk along the parameter's partition dim
  (`tensor_parallel.layers.shard_box`); a replicated parameter is the whole tensor on every rank;
- pipeline parallelism: each stage owns other names (the tied embedding: both of its stages);
- data parallelism: every replica holds the same boxes; DCP writes one copy of each (its dedup
  spreads the writes over the replicas);
- a distributed optimizer (issue 17; its state sharded across the data-parallel replicas)
  holds, per rank, pieces of the stage's flat layout (pipeline/weights.py), its `state_dict()`
  in the *pieces form*:

      {"sharded": {...this rank's place...}, "steps": k,
       "pieces": [{"range": (lo, hi), "exp_avg": [hi - lo], ..., "master": [hi - lo]?}]}

  Each piece's buffer is elements [lo, hi) of the flat layout: `flat_shards(prefix, buf, lo)`,
  at most 2k-1 boxes per k-dim parameter (`flat_range_boxes`), each contiguous in memory. Its
  per-element buffers are `optimizer.<key>.<name>` as above and an fp32 "master" is
  `model.<name>` (then the engine state's `newest` is not saved from this rank: the pieces are
  the exact fp32 weights; a loading rank reads both). "sharded" describes the rank, not the state: it is never saved, and
  a loading rank keeps its own. So a sharded optimizer state is one more sharding of the same
  global tensors: it loads into any layout with or without a distributed optimizer, and any
  checkpoint loads into it (`empty_state` shapes the buffers like this rank's pieces).

Saving reads the boxes from the engine state's flat buffers (views, no copy); loading writes them
into flat buffers of this engine's layout (`empty_state`), which `PipelineEngine.load_state_dict`
then takes as if they had been saved by this layout.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megatron_2bw.tensor_parallel.layers import shard_box

MODEL, PREVIOUS, OPTIMIZER = "model.", "model_previous.", "optimizer."


@dataclass(frozen=True)
class Shard:
    """One box of a global tensor: `tensor` (contiguous) sits at `offsets` of `global_shape`."""
    name: str
    tensor: torch.Tensor
    global_shape: tuple
    offsets: tuple


@dataclass(frozen=True)
class ParamBox:
    """Where a stage parameter lives: in the stage's flat buffers (`flat_offset`, `local_shape`)
    and in its global tensor (`name`, `global_shape`, `offsets`)."""
    name: str
    flat_offset: int
    local_shape: tuple
    global_shape: tuple
    offsets: tuple

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)


def param_boxes(weights, renames: dict[str, str], tp_rank: int, tp_size: int
                 ) -> list[ParamBox]:
    """The ParamBoxes of a stage's flat layout (`VersionedWeights`: names, shapes, offsets,
    partition dims); `renames` maps the stage's names of tied copies to one-process names."""
    out, offset = [], 0  # the unpadded layout (the engine state's; pipeline/weights.py `pack`)
    for name, shape, dim in zip(weights.names, weights.shapes, weights.partition_dims):
        full, offsets = shard_box(shape, dim, tp_rank, tp_size)
        out.append(ParamBox(renames.get(name, name), offset, tuple(shape), full, offsets))
        offset += math.prod(shape)
    return out


def flat_range_boxes(shape: tuple, lo: int, hi: int) -> list[tuple[tuple, tuple]]:
    """(offsets, sizes) of boxes that cover elements [lo, hi) of a row-major tensor of `shape`,
    in order; each box is contiguous in memory (a partial first row, whole rows, a partial last
    row, recursively): at most 2k-1 boxes for k dims."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,))]
    inner = math.prod(shape[1:])
    first, last = lo // inner, (hi - 1) // inner

    def row(r: int, a: int, b: int) -> list:
        return [((r,) + o, (1,) + s) for o, s in flat_range_boxes(shape[1:], a, b)]

    if first == last:
        return row(first, lo - first * inner, hi - first * inner)
    out, full_from = [], first
    if lo % inner:
        out += row(first, lo % inner, inner)
        full_from = first + 1
    full_to = last + 1 if hi % inner == 0 else last
    if full_to > full_from:
        out.append(((full_from,) + (0,) * (len(shape) - 1),
                    (full_to - full_from,) + tuple(shape[1:])))
    if hi % inner:
        out += row(last, 0, hi % inner)
    return out


def _ravel(offsets: tuple, shape: tuple) -> int:
    index = 0
    for o, s in zip(offsets, shape):
        index = index * s + o
    return index


def flat_shards(prefix: str, flat: torch.Tensor, lo: int, params: list[ParamBox]) -> list[Shard]:
    """Shards of `flat`, which holds elements [lo, lo + flat.numel()) of the stage's flat layout
    (lo = 0 and every element for an unsharded buffer); views of `flat`, no copies."""
    hi = lo + flat.numel()
    out = []
    for p in params:
        a, b = max(lo, p.flat_offset), min(hi, p.flat_offset + p.numel)
        for offsets, sizes in flat_range_boxes(p.local_shape, a - p.flat_offset,
                                               b - p.flat_offset):
            start = p.flat_offset + _ravel(offsets, p.local_shape) - lo
            view = flat[start:start + math.prod(sizes)].view(sizes)
            out.append(Shard(prefix + p.name, view, p.global_shape,
                             tuple(o + g for o, g in zip(offsets, p.offsets))))
    return out


LAYOUT_KEYS = ("pieces", "sharded")  # the pieces form's structure, not saved as state


def _is_flat(value, numel: int) -> bool:
    """A per-element buffer of the whole flat layout (not a scalar such as a step count)."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == numel


def state_shards(state: dict, params: list[ParamBox], numel: int, reading: bool = False
                 ) -> tuple[list[Shard], dict]:
    """(tensor shards, the optimizer's other entries) of an engine state dict
    (`PipelineEngine.state_dict()` to save, `empty_state` to read into with `reading`): newest,
    previous, and every per-element optimizer buffer, whole (flat form) or in pieces (the pieces
    form, module docstring; its masters are saved instead of newest, and read as well)."""
    optimizer = state.get("optimizer") or {}
    pieces = optimizer.get("pieces") or []
    shards, other = [], {}
    for key, value in optimizer.items():
        if _is_flat(value, numel):
            shards += flat_shards(f"{OPTIMIZER}{key}.", value, 0, params)
        elif key not in LAYOUT_KEYS:
            other[key] = value
    for piece in pieces:
        lo = piece["range"][0]
        for key, value in piece.items():
            if key != "range":
                prefix = MODEL if key == "master" else f"{OPTIMIZER}{key}."
                shards += flat_shards(prefix, value, lo, params)
    masters = any("master" in piece for piece in pieces)
    for prefix, key in ((MODEL, "newest"), (PREVIOUS, "previous")):
        flat = state.get(key)
        if flat is not None and (reading or not (masters and key == "newest")):
            shards += flat_shards(prefix, flat, 0, params)
    return shards, other


def _empty_like(value):
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value, device="cpu")
    if isinstance(value, dict):
        return {k: _empty_like(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_empty_like(v) for v in value]
    return value


def empty_state(numel: int, previous_dtype: torch.dtype | None, optimizer_state: dict) -> dict:
    """CPU buffers to load a checkpoint into, shaped like an engine's state dict: the newest
    weights (fp32), the previous version (2BW: `previous_dtype`, else None) and the optimizer's
    tensors (like `optimizer_state`'s, flat or pieces form; its other entries as they are)."""
    return {"newest": torch.empty(numel, dtype=torch.float32, device="cpu"),
            "previous": None if previous_dtype is None else torch.empty(
                numel, dtype=previous_dtype, device="cpu"),
            "optimizer": _empty_like(optimizer_state)}
