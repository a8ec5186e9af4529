"""pretrain_gpt.py --load of a megatron-core checkpoint (issue 45), through the whole front
door: the pre-process-group checks (checkpoint/api.preflight, checkpoint/resume.py), the
"not verified" line, the load and the continued training from the checkpoint's iteration; and
an architecture that differs refused in one line before any process group (exit 2)."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

import mcore_models as mc
from megatron_2bw.training.spawn import spawn

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def megatron_checkpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mcore-cli")
    spawn(mc.save_worker, 1, args=([("gpt-learned", 1, str(tmp / "ckpt"))],
                                   str(tmp / "losses.pt")), timeout_minutes=3)
    return tmp / "ckpt"


def run(args, cwd, stages=1):
    launch = [] if stages == 1 else ["-m", "torch.distributed.run", "--standalone",
                                     "--nproc_per_node", str(stages)]
    _, flags = mc.our_flags("gpt-learned", 1, stages, iters=mc.ITERATION + 2)
    return subprocess.run([sys.executable, *launch, str(ROOT / "pretrain_gpt.py"), *flags,
                           "--log-interval", "1", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=180,
                          env={"PATH": "/usr/bin:/bin", "WANDB_MODE": "offline",
                               "HOME": str(cwd)})


@pytest.mark.parametrize("stages", [1, 2], ids=["one-process", "2bw-d2"])
def test_pretrain_continues_a_megatron_core_checkpoint(megatron_checkpoint, tmp_path, stages):
    proc = run(["--load", megatron_checkpoint, "--save", tmp_path / "ours"], tmp_path, stages)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert f"checkpoint {megatron_checkpoint}/iter_{mc.ITERATION:07d}: not written by " \
           "megatron-2bw: files not verified" in out
    assert f"loading checkpoint from {megatron_checkpoint} at iteration {mc.ITERATION}" in out
    its = [int(x) for x in re.findall(r"iteration\s+(\d+)/\s*\d+ \|", out)]
    assert its[:2] == [mc.ITERATION + 1, mc.ITERATION + 2], out[-2000:]
    assert (tmp_path / "ours" / "latest_checkpointed_iteration.txt").read_text().strip() == \
        str(mc.ITERATION + 2)
    assert sorted(p.name for p in megatron_checkpoint.iterdir()) == \
        ["iter_0000005", "latest_checkpointed_iteration.txt"]  # --load untouched


def test_an_architecture_that_differs_stops_before_any_process_group(megatron_checkpoint,
                                                                     tmp_path):
    proc = run(["--load", megatron_checkpoint, "--num-layers", "3"], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.endswith("differs from this run: num_layers 2 (this run: 3; use --num-layers "
                         "2)"), last
