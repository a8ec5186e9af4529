"""The layout-free checkpoint format (`--ckpt-format torch_dist`, the default), built on
torch.distributed.checkpoint (DCP), as Megatron's torch_dist and torchtitan are:

    {save}/latest_checkpointed_iteration.txt   the newest complete iteration
    {save}/iter_0000100/
        .metadata                              DCP: every tensor's global name, shape, dtype,
                                               chunks and where each chunk is
        __<rank>_0.distcp                      DCP: the boxes rank <rank> wrote
        common.pt                              iteration, consumed samples, schedule, loss
                                               scaler, skipped steps, optimizer step count,
                                               config and the layout that saved it
        checksums.sha256                       sha256 of each file above (`sha256sum -c`),
                                               computed while writing

Tensors are named globally (shards.py: `model.<name>`, `model_previous.<name>` under 2BW,
`optimizer.<exp_avg|exp_avg_sq|momentum|last_grad>.<name>`), each rank writes its own boxes
and data-parallel replicas share the work, so a job with any (t, d, w), any schedule and any
optimizer sharding loads it (load.py); loading into flush or gpipe takes the newest version.
Saving (save.py) is all-or-nothing: files go to `.tmp-iter_XXXXXXX` and the directory is renamed
and `latest` moved only after every rank's files are durable; with --async-save the files are
written by a background thread from host copies while training continues.

Owns: the torch_dist format: global tensor boxes (shards.py), DCP storage with checksums
(storage.py), the collective save and its publication (save.py), resharding loads (load.py).
Must not import: config, schedule, pipeline, models, parallel, data, planner, deepspeed, testing,
pretrain, generate.
"""
