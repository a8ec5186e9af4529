"""pretrain_gpt.py --load of a Megatron-DeepSpeed checkpoint written by the real DeepSpeed
pipeline engine (issue 45; tests/mds_models.py), through the whole front door: the
pre-process-group checks find DeepSpeed's `latest` tag beside Megatron-DeepSpeed's
latest_checkpointed_iteration.txt, the "not verified" line, the load and the continued training
from the checkpoint's iteration at 2 stages; an architecture that differs is refused in one
line before any process group (exit 2); m2bw-inspect names the format, the writer
(Megatron-DeepSpeed, or DeepSpeed for a save without Megatron's client state under a tag of
any name), the iteration and the layout, and a damaged file in one line. --load is
byte-identical afterwards every time."""
import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mds_models as mds
from megatron_2bw.checkpoint.files import CheckpointError, latest_iteration
from megatron_2bw.checkpoint.inspect import inspect
from megatron_2bw.training.spawn import spawn

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def deepspeed_checkpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deepspeed-cli")
    spawn(mds.save_worker, 2, args=([(0, False, str(tmp / "ckpt")), (1, True, str(tmp / "z1"))],
                                    str(tmp / "out.pt")), timeout_minutes=4)
    return tmp / "ckpt"


def _listing(d: Path) -> dict:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def run(cmd, cwd):
    return subprocess.run([sys.executable, *map(str, cmd)], cwd=cwd, capture_output=True,
                          text=True, timeout=240,
                          env={"PATH": "/usr/bin:/bin", "WANDB_MODE": "offline",
                               "HOME": str(cwd), "PYTHONPATH": str(ROOT)})


def pretrain(args, cwd, stages):
    launch = [] if stages == 1 else ["-m", "torch.distributed.run", "--standalone",
                                     "--nproc_per_node", str(stages)]
    return run([*launch, ROOT / "pretrain_gpt.py", *mds.our_flags(1, stages),
                "--log-interval", "1", *args], cwd)


def test_pretrain_continues_a_megatron_deepspeed_checkpoint(deepspeed_checkpoint, tmp_path):
    before = _listing(deepspeed_checkpoint)
    proc = pretrain(["--load", deepspeed_checkpoint, "--save", tmp_path / "ours"], tmp_path, 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert f"checkpoint {deepspeed_checkpoint}/global_step{mds.ITERATION}: not written by " \
           "megatron-2bw: files not verified" in out
    assert f"loading checkpoint from {deepspeed_checkpoint} at iteration {mds.ITERATION}" in out
    its = [int(x) for x in re.findall(r"iteration\s+(\d+)/\s*\d+ \|", out)]
    assert its[:2] == [mds.ITERATION + 1, mds.ITERATION + 2], out[-2000:]
    assert (tmp_path / "ours" / "latest_checkpointed_iteration.txt").read_text().strip() == \
        str(mds.ITERATION + 2)
    assert _listing(deepspeed_checkpoint) == before


def test_an_architecture_that_differs_stops_before_any_process_group(deepspeed_checkpoint,
                                                                     tmp_path):
    before = _listing(deepspeed_checkpoint)
    proc = pretrain(["--load", deepspeed_checkpoint, "--num-layers", "3"], tmp_path, 1)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.endswith("differs from this run: num_layers 2 (this run: 3; use --num-layers "
                         "2)"), last
    assert _listing(deepspeed_checkpoint) == before


def test_inspect_names_the_format_writer_iteration_and_layout(deepspeed_checkpoint, tmp_path):
    for ckpt, zero in ((deepspeed_checkpoint, 0), (deepspeed_checkpoint.parent / "z1", 1)):
        lines = inspect(str(ckpt))
        assert lines[0] == (f"checkpoint {ckpt} iteration {mds.ITERATION} (DeepSpeed pipeline, "
                            f"ZeRO-{zero}, fp32, written by Megatron-DeepSpeed)")
        assert lines[1].startswith("  saved by t=1 d=2 w=1 schedule 1F1B (DeepSpeed)")
        assert lines[2] == f"  model gpt layers {mds.LAYERS} hidden {mds.HIDDEN} heads " \
            f"{mds.HEADS} vocab {mds.VOCAB}"
        assert lines[3].startswith("  optimizer state: per parameter")
        assert lines[-1].endswith("not written by megatron-2bw: files not verified")
    # DeepSpeed's own (no Megatron client state) under a tag of another name: the iteration
    # comes from its record, the writer is DeepSpeed
    ckpt = tmp_path / "ckpt"
    shutil.copytree(deepspeed_checkpoint, ckpt)
    (ckpt / "latest_checkpointed_iteration.txt").unlink()
    (ckpt / f"global_step{mds.ITERATION}").rename(ckpt / "mytag")
    (ckpt / "latest").write_text("mytag")
    for state in (ckpt / "mytag").glob("mp_rank_*_model_states.pt"):
        record = torch.load(state, weights_only=False)
        torch.save({k: v for k, v in record.items() if k not in mds.client_state(
            argparse.Namespace(consumed_train_tokens=0), 0)}, state)
    assert latest_iteration(str(ckpt)) == mds.ITERATION
    lines = inspect(str(ckpt))
    assert lines[0].endswith("(DeepSpeed pipeline, ZeRO-0, fp32, written by DeepSpeed)")
    assert lines[1].startswith("  saved by t=1 d=2 w=1 ") and "consumed samples 12" in lines[1]
    path = ckpt / "mytag" / "layer_02-model_states.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as err:
        inspect(str(ckpt))
    line = str(err.value)
    assert "\n" not in line and line.startswith(
        f"checkpoint {ckpt} iteration {mds.ITERATION} is damaged: checkpoint file {path} is "
        "corrupted")



def test_inspect_names_deepspeed_and_megatron_deepspeed(deepspeed_checkpoint, tmp_path):
    proc = run([ROOT / "tools" / "checkpoint_inspect.py", deepspeed_checkpoint], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    first = proc.stdout.splitlines()[0]
    assert first == (f"checkpoint {deepspeed_checkpoint} iteration {mds.ITERATION} (DeepSpeed "
                     "pipeline, ZeRO-0, fp32, written by Megatron-DeepSpeed)"), first
