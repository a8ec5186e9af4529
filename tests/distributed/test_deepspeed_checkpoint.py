"""DeepSpeed's checkpoint layout has the native layouts' guarantees (issue item 3), on 2 gloo
processes (2 stages, hidden 32, 2 blocks): a save that fails on one rank mid-file is one error on
every rank and leaves `latest` and the tag it names untouched, with no temporary left behind
(nor the leftover of a killed save); a damaged or missing file is one line naming it on every
rank; a tag without checksums (written by DeepSpeed or an earlier version) still loads."""
import errno
import os
import shutil
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "examples", "deepspeed_style"))

import megatron_2bw as deepspeed  # noqa: E402
import train as example  # noqa: E402
from megatron_2bw.checkpoint.files import CheckpointError  # noqa: E402
from megatron_2bw.deepspeed import checkpoint as ds_checkpoint  # noqa: E402
from megatron_2bw.training.spawn import spawn  # noqa: E402

FAILING = "mp_rank_01_model_states.pt"  # stage 1 runs out of space half-way through this file


def _failing_writes(original):
    def write_with_checksum(path, write):
        if not path.endswith(FAILING):
            return original(path, write)

        def half(f):
            f.write(b"x" * 1000)
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(path, half)
    return write_with_checksum


def _attempt(fn) -> str | None:
    try:
        fn()
    except CheckpointError as e:
        return str(e)
    return None


def _listing(d: str) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(r, f), d): open(os.path.join(r, f), "rb").read()
            for r, _, fs in os.walk(d) for f in fs}


def _worker(rank, world, ck, outdir):
    torch.manual_seed(0)
    net = example.build_model(deepspeed, 2, num_layers=2)
    eng, _, _, _ = deepspeed.initialize(model=net, config=example.ds_config("2bw", 2, 2))
    comm = eng._engine.grid.comm
    batches = deepspeed.utils.RepeatingLoader(
        torch.utils.data.DataLoader(example.token_dataset(num_samples=64), batch_size=2))
    eng.train_batch(batches)
    if rank == 0:  # what a save killed half-way leaves: the next save removes it
        os.makedirs(os.path.join(ck, ".tmp-killed"))
        open(os.path.join(ck, ".tmp-killed", "layer_00-model_states.pt"), "wb").close()
    eng.save_checkpoint(ck, tag="good")
    good = _listing(os.path.join(ck, "good"))
    eng.train_batch(batches)
    out = {}
    original = ds_checkpoint.write_with_checksum
    ds_checkpoint.write_with_checksum = _failing_writes(original)
    out["new_tag"] = _attempt(lambda: eng.save_checkpoint(ck, tag="bad"))
    out["same_tag"] = _attempt(lambda: eng.save_checkpoint(ck, tag="good"))
    ds_checkpoint.write_with_checksum = original
    out["after_failures"] = sorted(os.listdir(ck))
    out["good_intact"] = _listing(os.path.join(ck, "good")) == good
    out["latest"] = open(os.path.join(ck, "latest")).read()
    comm.barrier()  # every rank has looked before rank 0 adds the legacy tag below
    if rank == 0:  # a tag as earlier versions wrote it: no checksums
        shutil.copytree(os.path.join(ck, "good"), os.path.join(ck, "legacy"),
                        ignore=shutil.ignore_patterns("*.sha256"))
    comm.barrier()
    out["legacy"] = _attempt(lambda: eng.load_checkpoint(ck, tag="legacy"))
    if rank == 0:  # stage 0's layer 1 damaged: stage 1 never reads it, yet must stop too
        layer = os.path.join(ck, "good", "layer_01-model_states.pt")
        data = bytearray(open(layer, "rb").read())
        data[len(data) // 2] ^= 0xFF
        with open(layer, "wb") as f:
            f.write(bytes(data))
    comm.barrier()
    out["damaged"] = _attempt(lambda: eng.load_checkpoint(ck))
    if rank == 0:
        os.unlink(os.path.join(ck, "good", "layer_01-model_states.pt"))
    comm.barrier()
    out["missing"] = _attempt(lambda: eng.load_checkpoint(ck))
    torch.save(out, os.path.join(outdir, f"{rank}.pt"))


def test_deepspeed_layout_saves_atomically_and_loads_verified():
    with tempfile.TemporaryDirectory() as ck, tempfile.TemporaryDirectory() as d:
        spawn(_worker, 2, args=(ck, d), timeout_minutes=2)
        res = [torch.load(os.path.join(d, f"{r}.pt")) for r in range(2)]
    ranks_agree = {k: res[0][k] == res[1][k] for k in res[0]}
    assert all(ranks_agree.values()), (ranks_agree, res)
    r = res[0]
    path = os.path.join(ck, "bad", FAILING)
    assert r["new_tag"] == (f"cannot write checkpoint file {os.path.join(ck, '.tmp-bad', FAILING)}"
                            ": No space left on device (ENOSPC) after 1000 bytes: free space on "
                            "that file system or point --save elsewhere; 'latest' in "
                            f"{ck} still names 'good', which is intact"), path
    assert r["same_tag"] is not None and r["same_tag"].endswith("still names 'good', which is "
                                                                "intact")
    assert r["after_failures"] == ["good", "latest"] and r["good_intact"]
    assert r["latest"] == "good"
    assert r["legacy"] is None
    layer = os.path.join(ck, "good", "layer_01-model_states.pt")
    assert r["damaged"] == (f"checkpoint file {layer} does not match its checksum: it is "
                            "truncated or corrupted; load an earlier iteration")
    assert r["missing"].startswith(f"checkpoint {os.path.join(ck, 'good')} has no file for "
                                   "layer 1 ") and "\n" not in r["missing"]
