"""Old-format checkpoints still load (issue 18): a checkpoint written by the code at commit e2f4b58
(tests/golden/ckpt_e2f4b58: old layer parameter names, a layout without architecture keys)
resumes with that commit's losses, reads as a full model, and converts to the layout-free
format; loading it into another layout is one line naming the difference and the fix."""
import json
import os
from pathlib import Path

import pytest
import torch
from torch.multiprocessing import ProcessRaisedException

from megatron_2bw.checkpoint.convert.native import read_checkpoint
from megatron_2bw.checkpoint.convert.to_dist import torch_to_dist
from megatron_2bw.checkpoint.dist.load import is_dist_checkpoint
from megatron_2bw.config.build import build_config
from megatron_2bw.pretrain import build_parser
from megatron_2bw.training.spawn import spawn
from test_resume import _worker

FIXTURE = Path(__file__).resolve().parents[1] / "golden" / "ckpt_e2f4b58"
FLAGS = ("--mock-data --num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 8 "
         "--vocab-size 32 --micro-batch-size 2 --global-batch-size 4 "
         "--pipeline-schedule 2bw --lr 3e-3 --log-interval 1 "
         # the settings the legacy checkpoint was trained with (its losses are compared)
         "--hidden-dropout 0 --attention-dropout 0 --lr-decay-style constant").split()


def make_cfg(argv, world=4):
    return build_config(build_parser("gpt").parse_args(FLAGS + argv), "gpt", world).config


def test_a_checkpoint_of_commit_e2f4b58_resumes_with_its_losses(tmp_path):
    expected = json.loads((FIXTURE / "expected_losses.json").read_text())
    cfg = make_cfg(["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                    "--train-iters", "5", "--load", str(FIXTURE)])
    spawn(_worker, 4, args=(cfg, str(tmp_path / "losses")), timeout_minutes=2)
    losses = torch.load(tmp_path / "losses.3")
    assert losses == pytest.approx(expected["losses"], rel=1e-6)


def test_it_reads_as_a_full_model_and_resumes_in_another_layout_as_torch_dist(tmp_path):
    full = read_checkpoint(str(FIXTURE))
    assert full.iteration == 3
    assert "layers.1.self_attention.qkv.weight" in full.state  # the old name `layers.1.qkv`
    assert full.state["layers.1.self_attention.qkv.weight"].shape == (48, 16)
    converted = str(tmp_path / "dist")
    assert torch_to_dist(str(FIXTURE), converted) == 3
    assert is_dist_checkpoint(os.path.join(converted, "iter_0000003"))
    cfg = make_cfg(["--pipeline-model-parallel-size", "2", "--train-iters", "5", "--load",
                    converted], world=2)  # t=1 instead of 2
    spawn(_worker, 2, args=(cfg, str(tmp_path / "losses")), timeout_minutes=2)
    expected = json.loads((FIXTURE / "expected_losses.json").read_text())["losses"]
    assert torch.load(tmp_path / "losses.1") == pytest.approx(expected, rel=1e-5)


def test_another_layout_is_one_line_naming_it_and_the_conversion(tmp_path):
    cfg = make_cfg(["--pipeline-model-parallel-size", "2", "--train-iters", "5", "--load",
                    str(FIXTURE)], world=2)
    with pytest.raises(ProcessRaisedException,
                       match=r"saved for another model or layout \(tensor 2 != 1\)"
                             r".*checkpoint_convert.py to-dist"):
        spawn(_worker, 2, args=(cfg, str(tmp_path / "x")), timeout_minutes=1)
