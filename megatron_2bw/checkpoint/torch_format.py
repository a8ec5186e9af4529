"""Megatron's layout (`--ckpt-format torch`): one file per stage and tensor rank of replica 0
(checkpoint/files.py), holding the stage's engine state; it loads only into the layout that
saved it. Files written by older versions of the model code load too: the layout dict without
the architecture keys (`legacy_layout`) and the layer parameter names before the attention and
MLP blocks became submodules (`legacy_names`).
"""
from __future__ import annotations

import os
import re
import zipfile

import torch

from megatron_2bw.checkpoint.files import (FILENAME, CheckpointError, agree, latest_iteration,
                                           optimizer_shard_name, problem_of, rank_dir,
                                           read_checkpoint_file, verify_checksum,
                                           write_with_checksum)

# the layer parameter names of commit e2f4b58 and before -> today's
_LEGACY_NAMES = ((re.compile(r"^(layers\.\d+\.)(qkv|qv_bias|proj)(\.|$)"),
                  r"\1self_attention.\2\3"),
                 (re.compile(r"^(layers\.\d+\.)(fc1|fc2)(\.|$)"), r"\1mlp.\2\3"))


def legacy_layout(saved: dict) -> dict:
    """A saved layout with the architecture keys that checkpoints written before them lack filled
    in as the only architecture they could hold (GPT-2 shaped)."""
    if not saved or "position_embedding_type" in saved:
        return saved
    return {"position_embedding_type": "learned_absolute", "normalization": "LayerNorm",
            "swiglu": False, "query_groups": saved.get("num_attention_heads"),
            "bias_linear": True, **saved}


def legacy_names(names: list[str]) -> list[str]:
    """Parameter names as the model code names them today (old checkpoints named the attention
    and MLP parameters of a layer without their submodule: `layers.3.qkv.weight`)."""
    out = []
    for name in names:
        for pattern, new in _LEGACY_NAMES:
            name = pattern.sub(new, name)
        out.append(name)
    return out


def stage_file(root: str, iteration: int, grid) -> str:
    return os.path.join(rank_dir(root, iteration, grid.tp_rank, grid.stage, grid.pipeline),
                        FILENAME)


def save_torch(save_dir: str, state: dict | None, payload: dict, grid, hooks,
               save_optim: bool = True, sharded: bool = False) -> str:
    """Collective: replica 0's stages write their files (`state`: the engine state on replica 0,
    and with the distributed optimizer (`sharded`) on every replica, which then writes its
    optimizer shard; None elsewhere); returns this rank's stage file. Every rank raises the same
    error when a write failed, and the files of that iteration are gone."""
    t = payload["iteration"]
    path = stage_file(save_dir, t, grid)
    problem, written = None, []
    if state is not None:
        optimizer = state.pop("optimizer", None) if (sharded or not save_optim) else None
        writes = []
        if grid.dp_rank == 0:
            stage = dict(payload, engine=state)
            if sharded and save_optim:
                stage["optimizer_shards"] = grid.data
            writes.append((path, stage))
        if sharded and save_optim:
            writes.append((os.path.join(os.path.dirname(path), optimizer_shard_name(grid.dp_rank)),
                           {"optimizer": optimizer, "iteration": t, "layout": payload["layout"]}))
        hooks.during_save(grid, t, path)
        try:
            for target, content in writes:
                written.append(target)
                write_with_checksum(target, lambda f, content=content: torch.save(content, f))
        except CheckpointError as e:
            problem = str(e)
    problem = agree(problem, grid)
    if problem:
        remove_stage_files(written)
        raise CheckpointError(problem)
    return path


def remove_stage_files(paths: list[str]) -> None:
    """Delete stage (and optimizer shard) files, their checksums and the directories they leave
    empty."""
    for path in paths:
        for p in (path, path + ".sha256"):
            if os.path.exists(p):
                os.unlink(p)
    for d in ((os.path.dirname(paths[0]), os.path.dirname(os.path.dirname(paths[0])))
              if paths else ()):
        try:
            os.rmdir(d)  # only when empty: other stages may still be removing theirs
        except OSError:
            pass


def torch_file_problem(path: str, t: int) -> str | None:
    """Why the stage (or optimizer shard) file `path` of iteration t cannot be used: missing, no
    checksum, or not matching it (truncated, corrupted); None when it is whole."""
    if not os.path.exists(path):
        return (f"checkpoint file {path} is missing: the checkpoint at iteration {t} is "
                "incomplete or was written with another parallel layout")
    return problem_of(lambda: verify_checksum(path))


def record_problem(path: str) -> str | None:
    """Why the zip records torch.load unpickles in a torch-format file (the zip index and
    `data.pkl`) are damaged, by zip's own CRC-32, else None. It reads no tensor data: a check
    for a reader that maps the tensors without reading them (torch.load(mmap=True); the
    resume check before any process group, on every rank), where hashing the whole file on
    every rank would read it world-size times. The loader checks the whole file's sha256."""
    if not os.path.exists(path):
        return f"checkpoint file {path} is missing: the checkpoint is incomplete"
    try:
        with zipfile.ZipFile(path) as z:
            pickles = [n for n in z.namelist() if n.endswith("/data.pkl")]
            for name in pickles:
                z.read(name)  # raises on a CRC-32 mismatch
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        pickles, why = None, f"{type(e).__name__}: {e}"
    if pickles:
        return None
    why = why if pickles is None else "no data.pkl record"
    return (f"checkpoint file {path} is truncated or corrupted ({why}): load an earlier "
            "iteration")


def read_torch(path: str, t: int, verify: bool = True) -> dict:
    """One stage file, checksum verified first (unless `verify` is False: checked already,
    files.verify_once), parameter names of old versions mapped to today's."""
    problem = torch_file_problem(path, t) if verify else None
    if problem:
        raise CheckpointError(problem)
    payload = read_checkpoint_file(path, verify=False)
    engine = payload.get("engine")
    if engine is not None and "names" in engine:
        payload["engine"] = dict(engine, names=legacy_names(engine["names"]))
    payload["layout"] = legacy_layout(payload.get("layout", {}))
    return payload


def first_stage_file(root: str, iteration: int | None = None) -> str:
    """The first stage's file of a torch-format checkpoint (whatever its layout)."""
    it = latest_iteration(root) if iteration is None else iteration
    one = os.path.join(rank_dir(root, it, 0, 0, 1), FILENAME)
    return one if os.path.exists(one) else os.path.join(rank_dir(root, it, 0, 0, 2), FILENAME)
