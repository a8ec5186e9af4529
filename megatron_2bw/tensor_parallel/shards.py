"""Tensor-parallel shards of full tensors: the chunk a tensor rank holds (`split_shard`, the one
`tensor_parallel.layers.sharded_normal` initializes) and the inverse, whole tensors from every
rank's shards (`merge_tensor_shards`: concatenation along each parameter's `partition_dim`)."""
from __future__ import annotations

import torch


def split_shard(full: torch.Tensor, dim: int | None, tensor: int, rank: int) -> torch.Tensor:
    """The chunk of `full` that tensor rank `rank` of `tensor` holds (contiguous chunks along the
    parameter's partition dim, as sharded_normal cuts them; replicated when dim is None)."""
    return full if dim is None else full.chunk(tensor, dim=dim)[rank]


def merge_tensor_shards(results: list[dict], problems: list[str]) -> list[dict]:
    """One result per (stage, dp replica) with tensor-parallel shards concatenated along their
    partition dim; replicated parameters must be bitwise equal across tensor ranks (each one
    that differs is appended to `problems`)."""
    groups: dict[tuple[int, int], list[dict]] = {}
    for res in results:
        groups.setdefault((res["stage"], res["dp"]), []).append(res)
    merged = []
    for shards in groups.values():
        shards.sort(key=lambda r: r["tp"])
        first = dict(shards[0])
        params = {}
        for name, value in first["params"].items():
            dim = first["partition_dims"].get(name)
            parts = [r["params"][name] for r in shards]
            if dim is None:
                if any(not torch.equal(parts[0], p) for p in parts[1:]):
                    problems.append(f"replicated parameter {name} differs across tensor "
                                    f"ranks on stage {first['stage']}")
                params[name] = parts[0]
            else:
                params[name] = torch.cat(parts, dim=dim)
        first["params"] = params
        merged.append(first)
    return merged
