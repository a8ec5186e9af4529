"""pretrain_gpt.py --load of a Megatron-DeepSpeed checkpoint written by the real DeepSpeed
pipeline engine (issue 45; tests/mds_models.py), through the whole front door: the
pre-process-group checks find DeepSpeed's `latest` tag beside Megatron-DeepSpeed's
latest_checkpointed_iteration.txt, the "not verified" line, the load and the continued training
from the checkpoint's iteration at 2 stages; an architecture that differs is refused in one
line before any process group (exit 2); m2bw-inspect names the format and the writer. --load
is byte-identical afterwards every time."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

import mds_models as mds
from megatron_2bw.testing.launch import spawn

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def deepspeed_checkpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deepspeed-cli")
    spawn(mds.save_worker, 2, args=([(0, False, str(tmp / "ckpt"))], str(tmp / "out.pt")),
          timeout_minutes=4)
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


def test_inspect_names_deepspeed_and_megatron_deepspeed(deepspeed_checkpoint, tmp_path):
    proc = run([ROOT / "tools" / "checkpoint_inspect.py", deepspeed_checkpoint], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    first = proc.stdout.splitlines()[0]
    assert first == (f"checkpoint {deepspeed_checkpoint} iteration {mds.ITERATION} (DeepSpeed "
                     "pipeline, ZeRO-0, fp32, written by Megatron-DeepSpeed)"), first
