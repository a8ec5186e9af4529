"""Which format an iteration directory holds and who wrote it, from its file names and (torch
format) the first stage file's keys, without reading a tensor:

    ours, torch_dist       .metadata + common.pt + checksums.sha256, no metadata.json
    ours, torch            mp_rank_*/model_optim_rng.pt with its .sha256 sidecar
    megatron-core          metadata.json (dist_checkpointing's), .metadata, *.distcp, common.pt
                           (or without metadata.json: a common.pt that is not ours);
                           written by this project (`--ckpt-format megatron`, to-megatron) when
                           common.pt holds our record and checksums.sha256 lists the files
    Megatron torch         mp_rank_*/model_optim_rng.pt without a sidecar, holding "model":
                           megatron-core names or the legacy `language_model.*` names
    DeepSpeed pipeline     a tag directory of layer_*model_states.pt / mp_rank_*_model_states.pt
                           (Megatron-DeepSpeed, DeepSpeed; checkpoint/deepspeed_pipe/)

Anything else in an iteration directory is "no checkpoint format this project reads" (one line).
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass

from megatron_2bw.checkpoint.files import FILENAME, CheckpointError

MCORE_METADATA = "metadata.json"
OURS_KEY = "megatron_2bw"  # our record inside a megatron-core common.pt we wrote
OURS, MCORE, MEGATRON_CORE_NAMES, MEGATRON_LEGACY = ("megatron-2bw", "megatron-core",
                                                     "Megatron (megatron-core names)",
                                                     "Megatron legacy")


@dataclass(frozen=True)
class Found:
    format: str      # "torch_dist", "megatron" (megatron-core torch_dist), "megatron-torch",
    #                  "torch", "deepspeed" (DeepSpeed's pipeline layout)
    writer: str
    verified: bool   # the files carry our checksums

    @property
    def foreign(self) -> bool:
        return self.format in ("megatron", "megatron-torch", "deepspeed")


def is_megatron_dist(directory: str) -> bool:
    return os.path.isfile(os.path.join(directory, MCORE_METADATA))


def megatron_dist_backend(directory: str) -> str | None:
    """dist_checkpointing's backend named in metadata.json (None: unreadable)."""
    try:
        return json.load(open(os.path.join(directory, MCORE_METADATA))).get("sharded_backend")
    except (OSError, ValueError, AttributeError):
        return None


def stage_files(directory: str) -> list[str]:
    """The mp_rank_* stage files of a torch-format iteration directory, in name order."""
    return sorted(glob.glob(os.path.join(directory, "mp_rank_*", FILENAME)))


def detect(directory: str) -> Found:
    """The format and writer of the checkpoint in an iteration directory (one-line
    CheckpointError when it holds none this project reads)."""
    from megatron_2bw.checkpoint.dist.load import is_dist_checkpoint
    from megatron_2bw.checkpoint.dist.storage import CHECKSUMS
    if is_megatron_dist(directory):
        backend = megatron_dist_backend(directory)
        if backend != "torch_dist":
            raise CheckpointError(f"checkpoint {directory} is a megatron-core distributed "
                                  f"checkpoint with the {backend!r} backend (metadata.json); this "
                                  "project reads its torch_dist backend: re-save it in Megatron "
                                  "with --ckpt-format torch_dist")
        ours = os.path.isfile(os.path.join(directory, CHECKSUMS))
        return Found("megatron", f"{OURS} (megatron-core format)" if ours else MCORE, ours)
    if is_dist_checkpoint(directory):
        if not os.path.isfile(os.path.join(directory, CHECKSUMS)) and _foreign_common(directory):
            return Found("megatron", MCORE, False)  # without its metadata.json
        return Found("torch_dist", OURS, True)
    files = stage_files(directory)
    if files:
        if os.path.exists(files[0] + ".sha256"):
            return Found("torch", OURS, True)
        return Found("megatron-torch", _torch_writer(files[0]), False)
    from megatron_2bw.checkpoint.deepspeed_pipe.files import is_tag_dir, tag_writer
    if is_tag_dir(directory):
        return Found("deepspeed", tag_writer(directory), False)
    what = ", ".join(sorted(os.listdir(directory))[:4]) if os.path.isdir(directory) else ""
    raise CheckpointError(f"checkpoint {directory} is in no format this project reads (it "
                          f"holds {what or 'nothing'}; expected torch_dist's .metadata and "
                          "*.distcp, megatron-core's metadata.json, mp_rank_*/"
                          f"{FILENAME}, or DeepSpeed's *model_states.pt): load a checkpoint "
                          "written by megatron-2bw, Megatron-LM, megatron-core or "
                          "(Megatron-)DeepSpeed")


def _foreign_common(directory: str) -> bool:
    """A common.pt that is not ours (ours always records the layout it was saved for)."""
    from megatron_2bw.checkpoint.megatron.pickles import load_megatron_file
    try:
        state = load_megatron_file(os.path.join(directory, "common.pt"))
    except Exception:  # noqa: BLE001 - missing or damaged: ours, reported as today
        return False
    return isinstance(state, dict) and "layout" not in state


def _torch_writer(path: str) -> str:
    from megatron_2bw.checkpoint.megatron.pickles import load_megatron_file as load
    from megatron_2bw.checkpoint.torch_format import record_problem
    problem = record_problem(path)  # zip's CRC-32 of what unpickles, before unpickling it
    if problem:
        raise CheckpointError(problem)
    try:
        payload = load(path, mmap=True)
    except Exception as e:  # noqa: BLE001 - a damaged file fails in many ways
        raise CheckpointError(f"cannot read checkpoint file {path} ({type(e).__name__}): it is "
                              "truncated or corrupted, or in no format this project reads") \
            from None
    model = payload.get("model") if isinstance(payload, dict) else None
    if not isinstance(model, dict):
        raise CheckpointError(f"checkpoint file {path} holds no checksum sidecar and no "
                              "Megatron model state ('model'): it is in no format this project "
                              "reads")
    return MEGATRON_LEGACY if "language_model" in model else MEGATRON_CORE_NAMES
