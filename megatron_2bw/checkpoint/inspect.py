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


def _header(root: str, it: int, fmt: str, common: dict, writer: str = "megatron-2bw"
            ) -> list[str]:
    par, m = common.get("parallel") or {}, common.get("layout") or {}
    lay = common.get("layout") or {}
    t, d, w = par.get("tensor", lay.get("tensor")), par.get("pipeline", lay.get("pipeline")), \
        par.get("data")
    return [f"checkpoint {root} iteration {it} ({fmt}, written by {writer})",
            f"  saved by t={t} d={d} w={w if w is not None else '?'} schedule "
            f"{common.get('schedule')} compensation {par.get('compensation', 'none')}; "
            f"consumed samples {common.get('consumed_samples')}",
            f"  model {m.get('family')} layers {m.get('num_layers')} hidden "
            f"{m.get('hidden_size')} heads {m.get('num_attention_heads')} vocab "
            f"{m.get('vocab_size')}"]


def inspect_dist(root: str, it: int, tensors: bool, header=None) -> list[str]:
    """Our torch_dist checkpoint (`header`: another reader's of its common state, else ours)."""
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
    header = header or _header(root, it, "torch_dist", read_common(directory, sums))
    return _report(header,
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
    from megatron_2bw.checkpoint.megatron.detect import detect
    found = detect(directory)
    if found.format == "megatron":
        return inspect_megatron(root, it, tensors, found)
    if found.format == "megatron-torch":
        return inspect_megatron_torch(root, it, tensors, found)
    if found.format == "deepspeed":
        from megatron_2bw.checkpoint.deepspeed_pipe.inspect import inspect_deepspeed
        return inspect_deepspeed(root, it, tensors, found, _header, _size)
    if is_dist_checkpoint(directory):
        return inspect_dist(root, it, tensors)
    return inspect_torch(root, it, tensors)


def _megatron_common(state: dict, names) -> dict:
    """A Megatron checkpoint's common state in the words of `_header` (`names`: its tensors',
    which say the family)."""
    from megatron_2bw.checkpoint.megatron.common import (args_of, consumed_samples,
                                                         model_settings, parallel_of)
    from megatron_2bw.checkpoint.megatron.detect import OURS_KEY
    ours = state.get(OURS_KEY)
    if ours:
        return ours
    args = args_of(state)
    family = "bert" if any(n.startswith(("encoder.", "lm_head.", "binary_head."))
                           for n in names) else "gpt"
    model, _ = model_settings(args, family)
    return {"parallel": dict(parallel_of(args), compensation="none"), "schedule":
            "1F1B (Megatron)" if args else None,
            "consumed_samples": consumed_samples(state, int(state.get("iteration", 0))),
            "layout": dict(model, family=family)}


def _tensor_names(directory: str) -> list[str]:
    if not os.path.exists(os.path.join(directory, METADATA)):
        return []
    from torch.distributed.checkpoint import FileSystemReader
    return list(FileSystemReader(directory).read_metadata().state_dict_metadata)


def inspect_megatron(root: str, it: int, tensors: bool, found) -> list[str]:
    """megatron-core's torch_dist format (Megatron-LM's, or our --ckpt-format megatron)."""
    from megatron_2bw.checkpoint.megatron.dist_read import (NOT_VERIFIED, optimizer_layout,
                                                            read_megatron_common)
    directory = iteration_dir(root, it)
    what = f"checkpoint {root} iteration {it}"
    if found.verified:
        state = read_megatron_common(directory, verified=True)
        return inspect_dist(root, it, tensors, _header(
            root, it, "megatron-core torch_dist", _megatron_common(
                state, _tensor_names(directory)), found.writer))
    for name in (METADATA, COMMON):
        if not os.path.exists(os.path.join(directory, name)):
            raise CheckpointError(f"{what} is incomplete: {name} is missing")
    state = read_megatron_common(directory)
    from torch.distributed.checkpoint import FileSystemReader
    metadata = FileSystemReader(directory).read_metadata()
    from megatron_2bw.checkpoint.megatron.dist_read import bytes_needed, unverified_problem
    needed = bytes_needed(metadata)
    stored = sorted(needed)
    for name in stored:
        problem = unverified_problem(directory, name, needed)
        if problem:
            raise CheckpointError(f"{what} is damaged: {problem}")
    lines, total = [], 0
    for name in sorted(os.listdir(directory)):
        size = os.path.getsize(os.path.join(directory, name))
        total += size
        lines.append(f"  {name:<24} {_size(size):>10}  not verified")
    tensor_lines = _tensor_lines(what, metadata)
    usable, why = optimizer_layout(state, metadata.state_dict_metadata)
    header = _header(root, it, "megatron-core torch_dist",
                     _megatron_common(state, metadata.state_dict_metadata), found.writer)
    header.append("  optimizer state: " + ("per parameter (loads here)" if usable else why))
    return header + [f"  {len(tensor_lines)} tensors in {len(stored)} shard files, "
                     f"{_size(total)}", "files:"] + lines + \
        (["tensors:"] + tensor_lines if tensors else []) + \
        [f"complete: every shard file is present and every tensor covered; {NOT_VERIFIED}"]


def _tensor_lines(what: str, metadata) -> list[str]:
    out = []
    for name, md in sorted(metadata.state_dict_metadata.items()):
        if not hasattr(md, "chunks"):
            continue
        covered = sum(math.prod(c.sizes) for c in md.chunks)
        if covered != math.prod(md.size):
            raise CheckpointError(f"{what} is incomplete: the chunks of {name} cover {covered} "
                                  f"of its {math.prod(md.size)} elements")
        out.append(f"  {name:<56} {str(tuple(md.size)):<16} "
                   f"{str(md.properties.dtype).replace('torch.', ''):<9} "
                   f"{len(md.chunks)} chunk{'s' if len(md.chunks) > 1 else ''}")
    return out


def inspect_megatron_torch(root: str, it: int, tensors: bool, found) -> list[str]:
    """Megatron's --ckpt-format torch: one file per tensor rank and stage."""
    from megatron_2bw.checkpoint.megatron.dist_read import NOT_VERIFIED
    from megatron_2bw.checkpoint.megatron.detect import stage_files
    from megatron_2bw.checkpoint.megatron.resume_check import foreign_state
    from megatron_2bw.checkpoint.megatron.pickles import load_megatron_file
    from megatron_2bw.checkpoint.megatron.torch_read import flatten
    directory = iteration_dir(root, it)
    state = foreign_state(directory, found)
    first = stage_files(directory)[0]
    common = _megatron_common(state, flatten(load_megatron_file(first, mmap=True)["model"]))
    par = common.get("parallel") or {}
    files = stage_files(directory)
    t, d = par.get("tensor") or 1, par.get("pipeline") or 1
    want = [os.path.join(rank_dir(root, it, r, p, d), FILENAME) for p in range(d)
            for r in range(t)]
    missing = [p for p in want if p not in files]
    if missing:
        raise CheckpointError(f"checkpoint {root} iteration {it} is incomplete: "
                              f"{os.path.relpath(missing[0], root)} is missing")
    lines, total, names = [], 0, []
    for path in files:
        size = os.path.getsize(path)
        total += size
        lines.append(f"  {os.path.relpath(path, root):<40} {_size(size):>10}  not verified")
    if tensors:
        for path in files:
            rel = os.path.relpath(os.path.dirname(path), root)
            model = load_megatron_file(path, mmap=True)["model"]
            names += [f"  {rel}: {n}" for n in flatten(model) if not n.endswith("_extra_state")]
    header = _header(root, it, "Megatron torch format", common, found.writer)
    return header + [f"  {len(files)} stage files, {_size(total)}", "files:"] + lines + \
        (["tensors (per stage file):"] + names if tensors else []) + \
        [f"complete: every stage file is present; {NOT_VERIFIED}"]


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
