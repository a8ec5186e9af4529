"""tools/checkpoint_inspect.py (issue 18): the report of a whole checkpoint in either format, and
one line naming the missing or damaged piece of a torn one (exit 1); loading a torn torch_dist
checkpoint is one line naming the file too."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_2bw.checkpoint.api import load_checkpoint
from megatron_2bw.checkpoint.files import CheckpointError
from megatron_2bw.checkpoint.inspect import main
from test_ckpt_async import _one_rank
from test_resume import make_cfg, run

ROOT = Path(__file__).resolve().parents[2]
LEGACY = ROOT / "tests" / "golden" / "ckpt_e2f4b58"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """A torch_dist checkpoint of iteration 2 written by two pipeline stages."""
    d = tmp_path_factory.mktemp("inspect")
    run(make_cfg(["--train-iters", "2", "--save", str(d / "ck")]), str(d / "losses"))
    return d / "ck"


def _copy(src, tmp_path) -> Path:
    dst = tmp_path / "ck"
    shutil.copytree(src, dst)
    return dst


def _inspect(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out.splitlines(), err.splitlines()


def test_the_report_of_a_whole_torch_dist_checkpoint(two_ranks):
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "checkpoint_inspect.py"),
                           str(two_ranks), "--tensors"], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"checkpoint {two_ranks} iteration 2 (torch_dist, written by megatron-2bw)"
    assert lines[1] == "  saved by t=1 d=2 w=1 schedule 2bw compensation none; consumed samples 16"
    assert lines[2] == "  model gpt layers 4 hidden 32 heads 4 vocab 512"
    files = [line.split()[0] for line in lines[lines.index("files:") + 1:lines.index("tensors:")]]
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp", "common.pt"]
    tensors = {line.split()[0]: line.split()[1:] for line in
               lines[lines.index("tensors:") + 1:-1]}
    assert tensors["model.layers.0.word_embeddings.weight"][:3] == ["(512,", "32)", "float32"]
    assert "model_previous.layers.4.mlp.fc2.weight" in tensors  # 2BW keeps two versions
    assert "optimizer.exp_avg_sq.layers.1.self_attention.qkv.weight" in tensors
    assert lines[-1] == "complete: every shard is present and matches its checksum"


def test_the_report_of_a_torch_format_checkpoint(capsys):
    code, out, err = _inspect(capsys, LEGACY)
    assert code == 0 and err == []
    assert out[0].startswith(f"checkpoint {LEGACY} iteration 3 (torch: Megatron's layout")
    assert out[1] == "  saved by t=2 d=2 w=? schedule 2bw compensation none; consumed samples 12"
    assert out[-1] == "complete: every stage file is present and matches its checksum"


@pytest.mark.parametrize("damage,line", [
    (lambda d: (d / "__1_0.distcp").unlink(),
     "is incomplete: __1_0.distcp (the shards rank 1 wrote) is missing"),
    (lambda d: (d / "checksums.sha256").unlink(),
     "is incomplete: checksums.sha256 is missing (the save did not finish)"),
    (lambda d: (d / "common.pt").unlink(), "is incomplete: common.pt is missing"),
    (lambda d: (d / ".metadata").write_bytes((d / ".metadata").read_bytes()[:-7]),
     "is damaged: .metadata does not match its checksum"),
])
def test_a_torn_torch_dist_checkpoint_is_one_line_naming_the_piece(two_ranks, tmp_path, capsys,
                                                                   damage, line):
    ck = _copy(two_ranks, tmp_path)
    damage(ck / "iter_0000002")
    code, out, err = _inspect(capsys, ck)
    assert code == 1 and out == []
    assert err == [f"error: checkpoint {ck} iteration 2 {line}"]


def test_a_torn_torch_format_checkpoint_is_one_line_naming_the_stage_file(tmp_path, capsys):
    ck = _copy(LEGACY, tmp_path)
    (ck / "iter_0000003" / "mp_rank_01_001" / "model_optim_rng.pt").unlink()
    code, out, err = _inspect(capsys, ck)
    assert code == 1 and err == [f"error: checkpoint {ck} iteration 3 is incomplete: "
                                 "iter_0000003/mp_rank_01_001/model_optim_rng.pt (stage 1, "
                                 "tensor rank 1) is missing"]
    code, _, err = _inspect(capsys, tmp_path / "nothing")
    assert code == 2 and err == [f"error: {tmp_path / 'nothing'} is not a directory"]


def test_loading_a_torn_checkpoint_is_one_line_naming_the_file(two_ranks, tmp_path):
    ck = _copy(two_ranks, tmp_path)
    (ck / "iter_0000002" / "__1_0.distcp").unlink()
    engine, cfg, grid = _one_rank(["--num-layers", "4", "--num-attention-heads", "4",
                                   "--global-batch-size", "8", "--pipeline-schedule", "2bw"])
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(str(ck), engine, cfg, grid)
    assert str(e.value) == (f"checkpoint file {ck}/iter_0000002/__1_0.distcp is missing: the "
                            "checkpoint is incomplete; load an earlier iteration")
