"""One of our checkpoints (torch_dist or torch format, any layout) as megatron-core's torch_dist
format, in one process: `tools/checkpoint_convert.py to-megatron --load OURS --save NEW`. The
same boxes a `--ckpt-format megatron` save writes (checkpoint/megatron/export.py): megatron-core's
dist_checkpointing.load reads NEW into its GPTModel / BertModel, Megatron-LM's --load continues
from it, and --load NEW here resumes exactly (our record rides along in its common.pt)."""
from __future__ import annotations

from megatron_2bw.checkpoint.dist.shards import Shard
from megatron_2bw.checkpoint.files import CheckpointError, iteration_dir, latest_iteration


def convert_to_megatron(load_dir: str, save_dir: str, iteration: int | None = None) -> int:
    """Write the checkpoint in `load_dir` (the newest iteration unless given) into `save_dir`
    (which must hold none) in megatron-core's format; returns the iteration."""
    import os

    from megatron_2bw.checkpoint.layout import config_from_dict
    from megatron_2bw.checkpoint.convert.to_dist import (check_empty, torch_format_state,
                                                         write_dist)
    from megatron_2bw.checkpoint.megatron.detect import detect
    from megatron_2bw.checkpoint.megatron.export import MegatronExport
    if not os.path.isdir(load_dir):
        raise CheckpointError(f"{load_dir} is not a checkpoint directory: fix the path")
    it = latest_iteration(load_dir) if iteration is None else iteration
    if it is None:
        raise CheckpointError(f"{load_dir} holds no checkpoint (no "
                              "latest_checkpointed_iteration.txt): pass a run's --save directory")
    check_empty(save_dir)
    directory = iteration_dir(load_dir, it)
    found = detect(directory)
    if found.format == "torch_dist":
        from megatron_2bw.checkpoint.dist.load import read_common, read_full
        common = read_common(directory)
        shards = [Shard(name, t, tuple(t.shape), (0,) * t.dim())
                  for name, t in read_full(directory, prefix="").items()]
    elif found.format == "torch":
        shards, common = torch_format_state(load_dir, it)
    else:
        raise CheckpointError(f"checkpoint {directory} is in megatron-core's format already "
                              f"(written by {found.writer}): Megatron loads it as it is")
    export = MegatronExport(config_from_dict(common["config"]), rank=0)
    shards, objects, common = export.apply(shards, {}, common)
    write_dist(save_dir, it, shards, objects, common, export.files)
    return it
