"""The files of one DeepSpeed pipeline save (a tag directory) and what they say of the run,
as deepspeed/runtime/engine.py (`_get_ckpt_name`, `_get_rank_zero_ckpt_name`,
`_common_checkpoint_state`) and deepspeed/runtime/pipe/module.py (`ckpt_layer_path`) name and
fill them:

    layer_XX-model_states.pt / layer_XX-model_TT-model_states.pt   layer XX (of tensor rank TT)
    mp_rank_MM_model_states.pt            model rank MM = stage * t + tensor rank (its
                                          PipelineParallelGrid's model-parallel rank)
    [bf16_]zero_pp_rank_D_mp_rank_MM_optim_states.pt   ZeRO: data-parallel rank D's partition

A state file holds DeepSpeed's keys (`DS_KEYS`) and the client state beside them
(Megatron-DeepSpeed's: args, checkpoint_version, iteration, tokens, rng_state, ...). Every file
is read through Megatron's allow-list unpickler (checkpoint/megatron/pickles.py: DeepSpeed's
files hold its enums and the client's objects), memory-mapped, after zip's CRC-32 of every
record (`zip_problem`: DeepSpeed writes no checksums of its own).
"""
from __future__ import annotations

import glob
import os
import re
import zipfile
from dataclasses import dataclass, field

from megatron_2bw.checkpoint.files import CheckpointError

LAYER = re.compile(r"layer_(\d+)-(?:model_(\d+)-)?model_states\.pt")
STATE = re.compile(r"mp_rank_(\d+)_model_states\.pt")
ZERO = re.compile(r"(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_?optim_states\.pt")
# what DeepSpeed's engine puts in a state file; the rest is the client's (load_checkpoint
# returns it as client_state)
DS_KEYS = ("module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes",
           "shared_params", "frozen_param_fragments", "lr_scheduler", "data_sampler",
           "random_ltd", "skipped_steps", "global_steps", "global_samples", "dp_world_size",
           "mp_world_size", "checkpoint_parallel_dimensions", "ds_config", "ds_version")
MEGATRON_DS, DEEPSPEED = "Megatron-DeepSpeed", "DeepSpeed"
DROP_IN_VERSION = "megatron_2bw"  # the ds_version of deepspeed/checkpoint.py's state files


@dataclass
class TagFiles:
    directory: str
    layers: dict[int, dict[int, str]] = field(default_factory=dict)  # index -> tp -> path
    states: dict[int, str] = field(default_factory=dict)             # model rank -> path
    zero: dict[int, dict[int, str]] = field(default_factory=dict)    # model rank -> dp -> path

    @property
    def tensor(self) -> int:
        return 1 + max((tp for by_tp in self.layers.values() for tp in by_tp), default=0)

    def state(self, stage: int, tp: int = 0) -> str:
        mp = stage * self.tensor + tp
        if mp not in self.states:
            raise CheckpointError(f"checkpoint {self.directory} lacks mp_rank_{mp:02d}_model_"
                                  f"states.pt (stage {stage}, tensor rank {tp}): the checkpoint "
                                  "is incomplete; copy it again or load another tag")
        return self.states[mp]


def expected_files(files: TagFiles, record: dict) -> list[str]:
    """Every file the save must hold, by the layout its first state file records (one
    CheckpointError naming the first that is missing)."""
    par = parallel(record, files)
    out = [files.state(s, tp) for s in range(par["pipeline"]) for tp in range(par["tensor"])]
    zero = zero_stage(record)
    for mp in range(par["pipeline"] * par["tensor"]) if zero else ():
        for d in range(par["data"] or 1):
            if d not in files.zero.get(mp, {}):
                raise CheckpointError(f"checkpoint {files.directory} lacks the ZeRO-{zero} file "
                                      f"of data-parallel rank {d} of model rank {mp} "
                                      f"(zero_pp_rank_{d}_mp_rank_{mp:02d}_optim_states.pt): "
                                      "the checkpoint is incomplete; copy it again or load "
                                      "another tag")
            out.append(files.zero[mp][d])
    for idx, by_tp in sorted(files.layers.items()):
        lacking = [tp for tp in range(files.tensor) if tp not in by_tp]
        if lacking:
            raise CheckpointError(f"checkpoint {files.directory} lacks layer {idx}'s file of "
                                  f"tensor rank {lacking[0]}: the checkpoint is incomplete")
        out += [by_tp[tp] for tp in sorted(by_tp)]
    return out


def is_tag_dir(directory: str) -> bool:
    return os.path.isdir(directory) and any(
        STATE.fullmatch(n) or LAYER.fullmatch(n) for n in os.listdir(directory))


def tag_files(directory: str) -> TagFiles:
    out = TagFiles(directory)
    for path in sorted(glob.glob(os.path.join(directory, "*.pt"))):
        name = os.path.basename(path)
        if m := LAYER.fullmatch(name):
            out.layers.setdefault(int(m.group(1)), {})[int(m.group(2) or 0)] = path
        elif m := STATE.fullmatch(name):
            out.states[int(m.group(1))] = path
        elif m := ZERO.fullmatch(name):
            out.zero.setdefault(int(m.group(3)), {})[int(m.group(2))] = path
    if not out.states:
        raise CheckpointError(f"checkpoint {directory} holds DeepSpeed layer files but no "
                              "mp_rank_*_model_states.pt: the checkpoint is incomplete; copy it "
                              "again or load another tag")
    return out


def zip_problem(path: str) -> str | None:
    """What can be told of a DeepSpeed file without checksums: missing, or a zip record whose
    CRC-32 fails (truncated or corrupted); None when whole."""
    if not os.path.exists(path):
        return f"checkpoint file {path} is missing: the checkpoint is incomplete"
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, OSError, EOFError, RuntimeError) as e:
        return (f"checkpoint file {path} is truncated or corrupted ({type(e).__name__}): copy "
                "it again or load another tag")
    if bad is not None:
        return (f"checkpoint file {path} is corrupted (its record {bad} fails zip's CRC-32): "
                "copy it again or load another tag")
    return None


def read_file(path: str, check: bool = True) -> dict:
    """A DeepSpeed file's contents (tensors memory-mapped, not read), after the CRC-32 of its
    pickled record unless `check` is False (checked already: zip_problem checks every record,
    once per job); a file that does not unpickle is one CheckpointError."""
    from megatron_2bw.checkpoint.megatron.pickles import load_megatron_file
    from megatron_2bw.checkpoint.torch_format import record_problem
    problem = record_problem(path) if check else None
    if problem:
        raise CheckpointError(problem)
    try:
        state = load_megatron_file(path, mmap=True)
    except Exception as e:  # noqa: BLE001 - a damaged file fails in many ways
        raise CheckpointError(f"cannot read checkpoint file {path} ({type(e).__name__}): it is "
                              "truncated or corrupted; copy it again or load another tag") \
            from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint file {path} holds a {type(state).__name__}, not "
                              "DeepSpeed's state dict: it is in no format this project reads")
    return state


def client_record(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in DS_KEYS}


def writer(record: dict) -> str:
    """Megatron-DeepSpeed (its save_checkpoint's client state: args and iteration), this
    project's drop-in (megatron_2bw/deepspeed/checkpoint.py), else DeepSpeed."""
    if record.get("ds_version") == DROP_IN_VERSION:
        return "megatron-2bw (DeepSpeed layout)"
    return MEGATRON_DS if "args" in record and "iteration" in record else DEEPSPEED


def tag_writer(directory: str) -> str:
    """Who wrote the DeepSpeed tag directory (its first state file's record)."""
    return writer(read_file(tag_files(directory).state(0)))


def iteration_of(record: dict) -> int:
    return int(record.get("iteration", record.get("global_steps", 0)))


def zero_stage(record: dict) -> int:
    """The ZeRO stage of the run, from the DeepSpeed config it saved."""
    zero = (record.get("ds_config") or {}).get("zero_optimization") or {}
    try:
        return int(zero.get("stage", 0)) if isinstance(zero, dict) else 0
    except (TypeError, ValueError):
        return 0


def precision(record: dict) -> str:
    cfg = record.get("ds_config") or {}
    on = lambda key: bool((cfg.get(key) or {}).get("enabled"))  # noqa: E731
    return "fp16" if on("fp16") else "bf16" if on("bf16") or on("bfloat16") else "fp32"


def parallel(record: dict, files: TagFiles) -> dict:
    """(t, d, w) that saved it, in resume.py's words (DeepSpeed's schedule is 1F1B: our flush)."""
    dims = record.get("checkpoint_parallel_dimensions") or {}
    t = dims.get("tp_degree") or files.tensor
    d = dims.get("pp_degree") or max(1, len(files.states) // t)
    w = record.get("dp_world_size")
    return {"tensor": t, "pipeline": d, "data": w, "world": t * d * w if w else None,
            "schedule": "flush"}
