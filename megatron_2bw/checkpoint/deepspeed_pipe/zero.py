"""A DeepSpeed stage's optimizer state per parameter name (the stage module's names:
`tied_modules.embed.word_embeddings.weight`, `3.mlp.dense_h_to_4h.weight`), as its engine saved
it (deepspeed/runtime/engine.py `_common_checkpoint_state`, `_save_zero_checkpoint`):

- ZeRO-1/2 and the bf16 optimizer (the zero files, one per data-parallel rank): each holds its
  rank's contiguous partition of every flat fp32 group (`single_partition_of_fp32_groups`) and
  the base optimizer's state of that partition (`base_optimizer_state`: torch's state dict,
  one flat tensor per group, or the elastic list of them); `param_slice_mappings` names where in
  the partition each parameter's fragment lies (a parameter cut by a partition boundary has a
  fragment on each rank, in rank order). Files without it are cut by the state file's
  `param_shapes` (the flat group's order) and `param_alignment_paddings`, as
  deepspeed/utils/zero_to_fp32.py does. The fp32 master weights come with it.
- ZeRO-0 (the state file's "optimizer", torch's optimizer state dict): keyed by position in its
  param groups, which record no names. The names are the module's parameters in its order
  (`params`: a PipelineModule registers its tied modules first, then its layers by index), in
  one group or cut into groups by Megatron-DeepSpeed's rule (get_param_groups: weight decay off
  for biases and 1-d parameters, that group second); every saved state's shape must match, or
  the optimizer state cannot be mapped (said in one line by the caller). DeepSpeed's fp16
  optimizer at ZeRO-0 (flat groups, no names) is not mapped.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

_KEYS = ("exp_avg", "exp_avg_sq", "momentum_buffer")


@dataclass
class StageOptimizer:
    tensors: dict[str, dict[str, torch.Tensor]]  # name -> {exp_avg, exp_avg_sq | momentum_buffer,
    #                                               fp32 (ZeRO's master)}, each flat
    steps: int | None
    groups: list[dict]                          # the param groups' hyperparameters


def _step(value) -> int | None:
    if value is None:
        return None
    return int(value.item() if torch.is_tensor(value) else value)


def _hyper(groups) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in groups or ()]


def stage_optimizer(record: dict, zero: list[dict], params: list[tuple[str, tuple]] | None
                    ) -> tuple[StageOptimizer | None, str | None]:
    """(the stage's optimizer state, None) or (None, why it cannot be mapped). `record`: the
    stage's state file; `zero`: its zero files' optimizer_state_dict by data-parallel rank;
    `params`: the stage module's (name, shape) in its order (ZeRO-0 only)."""
    if zero:
        return _from_zero(record, zero)
    opt = record.get("optimizer")
    if not opt:
        return None, "the checkpoint holds no optimizer state"
    if "state" not in opt or "param_groups" not in opt:
        return None, ("DeepSpeed's fp16 optimizer at ZeRO-0 saves flat groups without names "
                      f"({', '.join(sorted(opt)[:3])} ...); save it with ZeRO-1 to carry Adam's "
                      "moments over")
    return _from_torch(opt, params or [])


def _from_torch(opt: dict, params: list[tuple[str, tuple]]):
    sizes = [len(g["params"]) for g in opt["param_groups"]]
    for order in _orders(params, len(sizes)):
        if [len(o) for o in order] != sizes:
            continue
        tensors, ok = {}, True
        for group, names in zip(opt["param_groups"], order):
            for pid, (name, shape) in zip(group["params"], names):
                state = opt["state"].get(pid) or opt["state"].get(str(pid))
                if state is None:
                    continue  # never stepped (no gradient reached it)
                got = {k: state[k] for k in _KEYS if torch.is_tensor(state.get(k))}
                if any(tuple(v.shape) != tuple(shape) for v in got.values()):
                    ok = False
                    break
                tensors[name] = {k: v.detach().reshape(-1) for k, v in got.items()}
            if not ok:
                break
        if ok:
            steps = {_step(s.get("step")) for s in opt["state"].values()} - {None}
            return StageOptimizer(tensors, max(steps) if steps else None,
                                  _hyper(opt["param_groups"])), None
    return None, (f"its ZeRO-0 optimizer state ({sum(sizes)} parameters in {len(sizes)} "
                  "groups) matches this model's parameters in neither their module order nor "
                  "Megatron-DeepSpeed's weight-decay groups")


def _orders(params, groups: int):
    """Candidate name orders of the param groups: the module order in one group or cut into
    Megatron-DeepSpeed's (weight decay, none) groups."""
    if groups == 1:
        yield [params]
    no_wd = [p for p in params if p[0].endswith(".bias") or len(p[1]) == 1]
    wd = [p for p in params if not (p[0].endswith(".bias") or len(p[1]) == 1)]
    yield [g for g in (wd, no_wd) if g]


def _from_zero(record: dict, zero: list[dict]):
    first = zero[0]
    groups = len(first.get("single_partition_of_fp32_groups") or ())
    if not groups:
        return None, "its ZeRO files hold no single_partition_of_fp32_groups"
    parts = []  # per rank, per group: {key: flat tensor of the partition}
    for sd in zero:
        base = sd.get("base_optimizer_state")
        states = [base["state"].get(g, base["state"].get(str(g), {})) for g in range(groups)] \
            if isinstance(base, dict) else list(base or [{}] * groups)
        parts.append([dict({k: v.detach() for k, v in s.items()
                            if torch.is_tensor(v) and v.dim() == 1},
                           fp32=sd["single_partition_of_fp32_groups"][g].detach())
                      for g, s in enumerate(states)])
    steps = _zero_steps(first, groups)
    hyper = _hyper(first["base_optimizer_state"]["param_groups"]) \
        if isinstance(first.get("base_optimizer_state"), dict) else []
    if all(sd.get("param_slice_mappings") for sd in zero):
        tensors = _by_mappings(zero, parts)
    elif record.get("param_shapes"):
        tensors = _by_shapes(record, zero, parts)
    else:
        return None, ("its ZeRO files hold neither param_slice_mappings nor the state file "
                      "param_shapes: which element is whose is not recorded")
    return StageOptimizer(tensors, steps, hyper), None


def _zero_steps(first: dict, groups: int) -> int | None:
    if first.get("base_optimizer_state_step") is not None:
        return _step(first["base_optimizer_state_step"])
    base = first.get("base_optimizer_state")
    if isinstance(base, dict):
        for g in range(groups):
            s = base["state"].get(g, base["state"].get(str(g), {}))
            if s.get("step") is not None:
                return _step(s["step"])
    return None


def _by_mappings(zero: list[dict], parts) -> dict[str, dict[str, torch.Tensor]]:
    pieces: dict[str, dict[str, list]] = {}
    for sd, rank_parts in zip(zero, parts):
        for g, names in enumerate(sd["param_slice_mappings"]):
            for name, where in names.items():
                start, numel = _address(where)
                for key, flat in rank_parts[g].items():
                    pieces.setdefault(name, {}).setdefault(key, []).append(
                        flat.narrow(0, start, numel))
    return {n: {k: torch.cat(v) if len(v) > 1 else v[0] for k, v in by_key.items()}
            for n, by_key in pieces.items()}


def _address(where) -> tuple[int, int]:
    if isinstance(where, dict):
        return int(where["start"]), int(where["numel"])
    if hasattr(where, "start"):
        return int(where.start), int(where.numel)
    state = getattr(where, "state", None) or {}  # an Opaque dataclass: its fields
    if isinstance(state, dict) and "start" in state:
        return int(state["start"]), int(state["numel"])
    numel, start = where.args  # fragment_address(numel, start), as pickled
    return int(start), int(numel)


def _by_shapes(record: dict, zero: list[dict], parts) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    aligned = zero[0].get("param_alignment_paddings")
    for g, shapes in enumerate(record["param_shapes"]):
        # a rigid state's tensors are the padded partition, the fp32 one never is
        lean = [{k: v[:p["fp32"].numel()] for k, v in p.items()} for p in
                (rank_parts[g] for rank_parts in parts)]
        full = {k: torch.cat([p[k] for p in lean]) for k in lean[0]}
        offset = 0
        for i, (name, shape) in enumerate(shapes.items()):
            numel = math.prod(shape)
            out[name] = {k: v.narrow(0, offset, numel) for k, v in full.items()}
            offset += numel + (aligned[g][i] if aligned else 0)
    return out
