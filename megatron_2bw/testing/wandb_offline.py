"""Read back the history of an offline wandb run (`run-*.wandb`) without network or account.

The file is wandb's transaction log: a 7-byte header (":W&B", magic, version) followed by
LevelDB-style log blocks of 32 KiB whose records are `wandb.proto` Record messages.
"""
from __future__ import annotations

import glob
import json
import os
import struct

BLOCK = 32768
HEADER = 7


def _records(path: str):
    data = open(path, "rb").read()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a wandb run file (no ':W&B' header)")
    pos, pending = HEADER, b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:  # block padding
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk


def _typed(run_dir: str, kind: str):
    """The `kind` records ("history", "run", ...) of an offline run directory, in order."""
    from wandb.proto import wandb_internal_pb2 as pb
    files = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    if not files:
        raise FileNotFoundError(f"no run-*.wandb file in {run_dir}")
    for raw in _records(files[0]):
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == kind:
            yield getattr(record, kind)


def read_history(run_dir: str) -> list[dict]:
    """[{metric: value, '_step': n}, ...] of an offline run directory (offline-run-*)."""
    return [{(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
             for item in history.item} for history in _typed(run_dir, "history")]


def read_run(run_dir: str) -> dict:
    """The run's identity as wandb.init recorded it: {"project", "entity", "display_name",
    "run_group"} (empty strings where not given)."""
    run = next(_typed(run_dir, "run"))
    return {key: getattr(run, key) for key in ("project", "entity", "display_name",
                                               "run_group")}
