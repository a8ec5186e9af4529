"""A checkpoint records every flag that changes what its tensors mean (issue 48 point 3,
checkpoint/layout.py): a resume that disagrees is one line naming both values and the flags that
match the checkpoint, before any process group (checkpoint/resume.resume_note, which pretrain
runs; the load checks the same layout again). Checkpoints written before a setting was recorded
still load: the setting comes from the config they saved, else it is the old default.

Checkpoints here are iteration 0 of a one-process model (convert/native.write_checkpoint,
--ckpt-format torch); tests/e2e/test_refused_runs_write_nothing.py refuses --apply-layernorm-1p
on a real run's torch_dist checkpoint through pretrain."""
import os
from pathlib import Path

import pytest
import torch

from megatron_2bw.checkpoint.convert.native import FullModel, write_checkpoint
from megatron_2bw.checkpoint.files import CheckpointError, write_with_checksum
from megatron_2bw.checkpoint.layout import MODEL_KEYS, saved_layout
from megatron_2bw.checkpoint.resume import resume_note
from megatron_2bw.config.build import build_config
from megatron_2bw.models.families import model_parts
from megatron_2bw.pretrain import build_parser
from megatron_2bw.testing.reference import build_sequential

FLAGS = ("--mock-data --num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
         "--vocab-size 64 --micro-batch-size 2 --global-batch-size 4 --train-iters 4").split()
ROPE = ["--position-embedding-type", "rope"]
GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "ckpt_e2f4b58"


def _cfg(argv, load=None, world=1):
    argv = FLAGS + list(argv) + (["--load", str(load)] if load else [])
    return build_config(build_parser("gpt").parse_args(argv), "gpt", world).config


def _checkpoint(where: Path, argv) -> Path:
    cfg = _cfg(argv)
    model = build_sequential(cfg, model_parts(cfg)[0])
    write_checkpoint(str(where), FullModel(cfg, {n: p.detach() for n, p in
                                                 model.named_parameters()}))
    return where


def _refusal(load: Path, argv) -> str:
    with pytest.raises(CheckpointError) as e:
        resume_note(_cfg(argv, load), 1)
    line = str(e.value)
    assert "\n" not in line
    return line


# (saved with, resumed with, the difference, the fix named)
CASES = [
    ([], ["--apply-layernorm-1p"], "apply_layernorm_1p False != True", "no --apply-layernorm-1p"),
    (["--apply-layernorm-1p"], [], "apply_layernorm_1p True != False", "(--apply-layernorm-1p)"),
    ([], ["--normalization", "RMSNorm"], "normalization LayerNorm != RMSNorm",
     "--normalization LayerNorm"),
    ([], ["--qk-layernorm"], "qk_layernorm False != True", "no --qk-layernorm"),
    (ROPE, ROPE + ["--rotary-base", "500000"], "rotary_base 10000.0 != 500000.0",
     "--rotary-base 10000"),
    (ROPE, ROPE + ["--rotary-percent", "0.5"], "rotary_percent 1.0 != 0.5",
     "--rotary-percent 1"),
    ([], ["--kv-channels", "8"], "kv_channels 16 != 8", "--kv-channels 16"),
    ([], ["--openai-gelu"], "openai_gelu False != True", "no --openai-gelu"),
    ([], ROPE, "position_embedding_type learned_absolute != rope",
     "--position-embedding-type learned_absolute"),
    ([], ["--swiglu"], "swiglu False != True", "no --swiglu"),
    ([], ["--disable-bias-linear"], "bias_linear True != False", "no --disable-bias-linear"),
    ([], ["--untie-embeddings-and-output-weights"], "tied True != False",
     "no --untie-embeddings-and-output-weights"),
    ([], ["--group-query-attention", "--num-query-groups", "1"], "query_groups 2 != 1",
     "--num-query-groups 2"),
]


@pytest.mark.parametrize("saved,resumed,difference,fix", CASES,
                         ids=[" ".join(c[1] or c[0]) for c in CASES])
def test_a_resume_that_changes_what_the_tensors_mean_is_one_line_naming_both_and_the_fix(
        tmp_path, saved, resumed, difference, fix):
    ckpt = _checkpoint(tmp_path / "ckpt", saved)
    line = _refusal(ckpt, resumed)
    assert line.startswith(f"checkpoint {ckpt}/iter_0000000 was saved for another model (")
    assert difference in line and fix in line and "use matching flags" in line
    assert resume_note(_cfg(saved, ckpt), 1) is None  # the same flags resume


def test_settings_that_mean_nothing_for_the_model_do_not_refuse(tmp_path):
    """RoPE's base and percent are None for learned positions; --norm-epsilon changes no
    tensor's meaning (module docstring of checkpoint/layout.py)."""
    ckpt = _checkpoint(tmp_path / "learned", [])
    assert resume_note(_cfg(["--rotary-base", "500000", "--rotary-percent", "0.5",
                             "--norm-epsilon", "1e-6"], ckpt), 1) is None


def _rewrite(ckpt: Path, edit) -> None:
    """Rewrite the checkpoint's stage file as a version of the code before this record wrote
    it (checksum and all)."""
    path = ckpt / "iter_0000000" / "mp_rank_00" / "model_optim_rng.pt"
    payload = torch.load(path, weights_only=True, map_location="cpu")
    edit(payload)
    write_with_checksum(str(path), lambda f: torch.save(payload, f))


NEW_KEYS = ("kv_channels", "rotary_base", "rotary_percent", "apply_layernorm_1p", "qk_layernorm",
            "openai_gelu", "bert_binary_head")


def test_a_checkpoint_written_before_the_record_reads_its_saved_config_then_the_default(
        tmp_path):
    """The rule for a setting a checkpoint does not record: the config it saved (what its model
    code built with), else the setting's default (a config without the field was written by code
    that knew no other value)."""
    flags = ROPE + ["--apply-layernorm-1p", "--rotary-base", "500000"]
    ckpt = _checkpoint(tmp_path / "old", flags)
    _rewrite(ckpt, lambda p: [p["layout"].pop(k) for k in NEW_KEYS])
    assert resume_note(_cfg(flags, ckpt), 1) is None  # its config says what it was
    line = _refusal(ckpt, ROPE + ["--rotary-base", "500000"])
    assert "apply_layernorm_1p True != False" in line
    assert "rotary_base 500000.0 != 10000.0" in _refusal(ckpt, ROPE + ["--apply-layernorm-1p"])

    def older(p):  # nor did its config have the fields
        for k in ("apply_layernorm_1p", "rotary_base"):
            p["config"]["model"].pop(k)
    _rewrite(ckpt, older)
    assert resume_note(_cfg(ROPE, ckpt), 1) is None  # the defaults: no 1p, base 10000
    line = _refusal(ckpt, flags)
    assert "apply_layernorm_1p False != True" in line and "rotary_base 10000.0 != 500000.0" in line


def test_saved_layout_fills_every_model_key_and_keeps_what_a_checkpoint_recorded():
    ours = _cfg(ROPE + ["--qk-layernorm"])
    from megatron_2bw.checkpoint.layout import layout
    full = layout(ours, ours.parallel)
    assert set(MODEL_KEYS) <= set(full) and saved_layout({"layout": full}) == full
    # the golden checkpoint of commit e2f4b58: neither architecture keys nor these
    old = torch.load(GOLDEN / "iter_0000003" / "mp_rank_00_000" / "model_optim_rng.pt",
                     weights_only=True, map_location="cpu")
    filled = saved_layout(old)
    assert {k: filled[k] for k in NEW_KEYS} == {
        "kv_channels": 8, "rotary_base": None, "rotary_percent": None,
        "apply_layernorm_1p": False, "qk_layernorm": False, "openai_gelu": False,
        "bert_binary_head": None}
    golden = ("--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 8 "
              "--vocab-size 32 --micro-batch-size 2 --global-batch-size 4 --train-iters 5 "
              "--pipeline-schedule 2bw --tensor-model-parallel-size 2 "
              "--pipeline-model-parallel-size 2").split()
    cfg = build_config(build_parser("gpt").parse_args(["--mock-data", *golden, "--load",
                                                       str(GOLDEN)]), "gpt", 4).config
    assert resume_note(cfg, 4) is None  # still resumes (tests/distributed/test_ckpt_legacy.py)
    assert os.path.isdir(GOLDEN)
