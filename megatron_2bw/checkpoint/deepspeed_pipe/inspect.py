"""`m2bw-inspect` of a DeepSpeed pipeline save (checkpoint/inspect.py dispatches here): the
format and writer (DeepSpeed, Megatron-DeepSpeed, this project's drop-in), the iteration, the
layout, the ZeRO stage and precision, the model its arguments name, whether its optimizer state
loads, every file with its size, and whether each is present and whole (zip's CRC-32 of every
record: DeepSpeed writes no checksums). A missing or damaged file is one CheckpointError."""
from __future__ import annotations

import os
from types import SimpleNamespace

from megatron_2bw.checkpoint.deepspeed_pipe import files as ds_files
from megatron_2bw.checkpoint.files import CheckpointError, iteration_dir
from megatron_2bw.checkpoint.megatron.common import model_settings
from megatron_2bw.checkpoint.megatron.dist_read import NOT_VERIFIED


def inspect_deepspeed(root: str, it: int, tensors: bool, found, header, size) -> list[str]:
    """The report's lines (`header`, `size`: checkpoint/inspect.py's formatters)."""
    directory = iteration_dir(root, it)
    what = f"checkpoint {root} iteration {it}"
    files = ds_files.tag_files(directory)
    record = ds_files.read_file(files.state(0))
    par = ds_files.parallel(record, files)
    zero = ds_files.zero_stage(record)
    try:
        expected = ds_files.expected_files(files, record)
    except CheckpointError as e:
        raise CheckpointError(f"{what} is incomplete: {e}") from None
    lines, total = [], 0
    for path in sorted(set(expected)):
        problem = ds_files.zip_problem(path)
        if problem:
            raise CheckpointError(f"{what} is damaged: {problem}")
        n = os.path.getsize(path)
        total += n
        lines.append(f"  {os.path.relpath(path, root):<48} {size(n):>10}  not verified, zip "
                     "CRC-32 ok")
    writer = found.writer
    head = header(root, it, f"DeepSpeed pipeline, ZeRO-{zero}, {ds_files.precision(record)}",
                  _common(record, files, par), writer)
    head.append("  optimizer state: " + _optimizer_line(directory, files, writer))
    listed = []
    if tensors:
        for idx, by_tp in sorted(files.layers.items()):
            for tp, path in sorted(by_tp.items()):
                for k, v in ds_files.read_file(path, check=False).items():
                    if hasattr(v, "shape"):
                        listed.append(f"  layer {idx} tensor rank {tp}: {k} {tuple(v.shape)} "
                                      f"{str(v.dtype).replace('torch.', '')}")
    return head + [f"  {len(files.layers)} layer files, {len(files.states)} state files, "
                   f"{sum(map(len, files.zero.values()))} ZeRO files, {size(total)}",
                   "files:"] + lines + (["tensors (per layer file):"] + listed if tensors
                                        else []) + \
        [f"complete: every state, ZeRO and layer file is present and whole; {NOT_VERIFIED}"]


def _common(record: dict, files, par: dict) -> dict:
    """The record in checkpoint/inspect.py's header words."""
    from megatron_2bw.checkpoint.deepspeed_pipe.megatron_ds import lm_args
    from megatron_2bw.checkpoint.megatron.common import args_of, consumed_samples
    args = lm_args(args_of(record))
    it = ds_files.iteration_of(record)
    model, _ = model_settings(args, "gpt")
    return {"parallel": dict(par, compensation="none"), "schedule": "1F1B (DeepSpeed)",
            "consumed_samples": consumed_samples({"args": args}, it) if args else
            record.get("global_samples"),
            "layout": dict(model, family="gpt" if args else "a PipelineModule")}


def _optimizer_line(directory: str, files, writer: str) -> str:
    """Whether --load carries the optimizer state over (Megatron-DeepSpeed's GPT), else what
    the files hold (the drop-in reads other PipelineModules')."""
    from megatron_2bw.checkpoint.deepspeed_pipe import megatron_ds as mds
    from megatron_2bw.checkpoint.deepspeed_pipe.megatron_read import (full_optimizer,
                                                                      stage_records)
    from megatron_2bw.checkpoint.megatron.common import args_of
    try:
        by_index = mds.roles(files)
    except CheckpointError:
        return (f"{'ZeRO partitions' if files.zero else 'ZeRO-0 torch state'} of a "
                "PipelineModule that is not Megatron-DeepSpeed's GPT (the drop-in's "
                "engine.load_checkpoint reads it)")
    records = stage_records(files)
    args = mds.lm_args(args_of(records[0][0]))
    heads = args.get("num_attention_heads") or 1
    m = SimpleNamespace(num_attention_heads=heads, kv_channels=args.get("kv_channels") or 1,
                        query_groups=args.get("num_query_groups") or heads,
                        swiglu=bool(args.get("swiglu")))
    _, shapes, _ = mds.full_weights(files, by_index, m, mds.thirds(args))
    got, _, why = full_optimizer(files, by_index, records, m, mds.thirds(args), shapes)
    return f"per parameter, {len(next(iter(got.values()), {}))} tensors (loads here)" \
        if not why else why
