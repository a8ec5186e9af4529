"""`tools/checkpoint_inspect.py`: what a checkpoint holds and whether it is whole.

    python tools/checkpoint_inspect.py CHECKPOINT_DIR [--iteration N] [--tensors]

Prints the format, the iteration, the layout and schedule that saved it, the data position, the
model, every file with its size and checksum verdict, and (--tensors) every tensor with its
global shape, dtype and chunks; the last line says whether every shard is present. A torn or
partial checkpoint (a file missing, a checksum that differs, a tensor whose chunks do not cover
it, a save that never finished) is one line on stderr naming the missing piece, exit 1; exit 2
when the directory holds no checkpoint at all.
"""
from __future__ import annotations

import math
import os
import re
import sys

from megatron_2bw.checkpoint.dist.load import is_dist_checkpoint, read_common
from megatron_2bw.checkpoint.dist.save import COMMON
from megatron_2bw.checkpoint.dist.storage import CHECKSUMS, METADATA, read_checksums
from megatron_2bw.checkpoint.files import (FILENAME, LATEST, CheckpointError, iteration_dir,
                                           latest_iteration, rank_dir, sha256_of)
from megatron_2bw.config.numbers import FiniteParser


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def _header(root: str, it: int, fmt: str, common: dict) -> list[str]:
    par, m = common.get("parallel") or {}, common.get("layout") or {}
    lay = common.get("layout") or {}
    t, d, w = par.get("tensor", lay.get("tensor")), par.get("pipeline", lay.get("pipeline")), \
        par.get("data")
    return [f"checkpoint {root} iteration {it} ({fmt})",
            f"  saved by t={t} d={d} w={w if w is not None else '?'} schedule "
            f"{common.get('schedule')} compensation {par.get('compensation', 'none')}; "
            f"consumed samples {common.get('consumed_samples')}",
            f"  model {m.get('family')} layers {m.get('num_layers')} hidden "
            f"{m.get('hidden_size')} heads {m.get('num_attention_heads')} vocab "
            f"{m.get('vocab_size')}"]


def inspect_dist(root: str, it: int, tensors: bool) -> list[str]:
    directory = iteration_dir(root, it)
    what = f"checkpoint {root} iteration {it}"
    if not os.path.exists(os.path.join(directory, CHECKSUMS)):
        raise CheckpointError(f"{what} is incomplete: {CHECKSUMS} is missing (the save did not "
                              "finish)")
    sums = read_checksums(directory)
    lines, total = [], 0
    for name in (METADATA, COMMON):
        if name not in sums:
            raise CheckpointError(f"{what} is incomplete: {CHECKSUMS} does not list {name}")
    for name, digest in sorted(sums.items()):
        path = os.path.join(directory, name)
        if not os.path.exists(path):
            rank = re.fullmatch(r"__(\d+)_\d+\.distcp", name)
            whose = f" (the shards rank {rank.group(1)} wrote)" if rank else ""
            raise CheckpointError(f"{what} is incomplete: {name}{whose} is missing")
        if sha256_of(path) != digest:
            raise CheckpointError(f"{what} is damaged: {name} does not match its checksum")
        size = os.path.getsize(path)
        total += size
        lines.append(f"  {name:<24} {_size(size):>10}  sha256 {digest[:16]}... ok")
    from torch.distributed.checkpoint import FileSystemReader
    metadata = FileSystemReader(directory).read_metadata()
    stored = {info.relative_path for info in metadata.storage_data.values()}
    missing = sorted(stored - set(sums))
    if missing:
        raise CheckpointError(f"{what} is incomplete: {missing[0]} holds shards but is not in "
                              f"{CHECKSUMS}")
    tensor_lines = []
    for name, md in sorted(metadata.state_dict_metadata.items()):
        if not hasattr(md, "chunks"):
            continue
        covered = sum(math.prod(c.sizes) for c in md.chunks)
        if covered != math.prod(md.size):
            raise CheckpointError(f"{what} is incomplete: the chunks of {name} cover {covered} "
                                  f"of its {math.prod(md.size)} elements")
        tensor_lines.append(f"  {name:<56} {str(tuple(md.size)):<16} "
                            f"{str(md.properties.dtype).replace('torch.', ''):<9} "
                            f"{len(md.chunks)} chunk{'s' if len(md.chunks) > 1 else ''}")
    return _report(_header(root, it, "torch_dist", read_common(directory, sums)),
                   f"{len(tensor_lines)} tensors in {len(stored)} shard files, {_size(total)}",
                   lines, ("tensors:", tensor_lines) if tensors else None, "every shard")


def inspect_torch(root: str, it: int, tensors: bool) -> list[str]:
    from megatron_2bw.checkpoint.torch_format import first_stage_file, read_torch
    what = f"checkpoint {root} iteration {it}"
    first = first_stage_file(root, it)
    if not os.path.exists(first):
        raise CheckpointError(f"{what} is incomplete: {os.path.relpath(first, root)} is missing")
    payload = read_torch(first, it)
    t, d = payload["layout"]["tensor"], payload["layout"]["pipeline"]
    lines, tensor_lines, total = [], [], 0
    for stage in range(d):
        for r in range(t):
            path = os.path.join(rank_dir(root, it, r, stage, d), FILENAME)
            rel = os.path.relpath(path, root)
            if not os.path.exists(path) or not os.path.exists(path + ".sha256"):
                missing = rel if not os.path.exists(path) else rel + ".sha256"
                raise CheckpointError(f"{what} is incomplete: {missing} (stage {stage}, tensor "
                                      f"rank {r}) is missing")
            try:
                state = read_torch(path, it)["engine"]
            except CheckpointError:
                raise CheckpointError(f"{what} is damaged: {rel} does not match its checksum "
                                      "or cannot be read") from None
            size = os.path.getsize(path)
            total += size
            lines.append(f"  {rel:<40} {_size(size):>10}  sha256 ok")
            tensor_lines += [f"  stage {stage} tensor rank {r}: {n}" for n in state["names"]]
    common = dict(payload, schedule=payload["engine"]["schedule"])
    return _report(_header(root, it, "torch: Megatron's layout, loads into the same layout only",
                           common), f"{t * d} stage files, {_size(total)}", lines,
                   ("tensors (flat per stage file, in this order):", tensor_lines)
                   if tensors else None, "every stage file")


def _report(header: list[str], summary: str, files: list[str], tensors, each: str) -> list[str]:
    """The report: header, summary, the files, the tensors when asked ((title, lines)), and
    the verdict on `each` file."""
    out = header + [f"  {summary}", "files:"] + files
    if tensors:
        out += [tensors[0]] + tensors[1]
    return out + [f"complete: {each} is present and matches its checksum"]


def inspect(root: str, iteration: int | None = None, tensors: bool = False) -> list[str]:
    """The report's lines; CheckpointError (one line) for a torn or partial checkpoint."""
    it = latest_iteration(root) if iteration is None else iteration
    if it is None:
        raise CheckpointError(f"{root} holds no checkpoint ({LATEST} is missing)")
    directory = iteration_dir(root, it)
    if not os.path.isdir(directory):
        raise CheckpointError(f"checkpoint {root} iteration {it} is missing: "
                              f"{os.path.basename(directory)} does not exist")
    if is_dist_checkpoint(directory):
        return inspect_dist(root, it, tensors)
    return inspect_torch(root, it, tensors)


def main(argv=None) -> int:
    p = FiniteParser(prog="checkpoint_inspect.py",
                     description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a checkpoint directory (a run's --save)")
    p.add_argument("--iteration", type=int, default=None, help="default: the newest (latest)")
    p.add_argument("--tensors", action="store_true", help="list every tensor")
    args = p.parse_args(argv)
    if not os.path.isdir(args.checkpoint):
        print(f"error: {args.checkpoint} is not a directory", file=sys.stderr)
        return 2
    try:
        print("\n".join(inspect(args.checkpoint, args.iteration, args.tensors)))
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
