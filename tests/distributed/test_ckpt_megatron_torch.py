"""Megatron's --ckpt-format torch checkpoints load (issue 45): one model_optim_rng.pt per tensor
rank and pipeline stage (megatron/training/checkpointing.py), with megatron-core's module names
or the legacy model's nested names (the key map in tests/mcore_models.py, cited from
NVIDIA/Megatron-LM megatron/legacy/model/{language_model,transformer}.py and
tools/checkpoint/loader_legacy.py), saved at t=2 (and cut into two pipeline stages, layers
numbered from 0 in each stage, the tied head's copy on the last); the weights are megatron-core's
own (GPTModel, local spec). Loaded at (1, 1, 1) and (2, 2, 1), the loss on the fixed batch equals
megatron-core's within 1e-5, and the optimizer's restart is said in one line."""
import math
import os
import shutil

import pytest
import torch

import mcore_models as mc
from megatron_2bw.config.build import build_config
from megatron_2bw.pretrain import build_parser
from megatron_2bw.training.spawn import spawn
from test_ckpt_megatron import load_and_evaluate, our_cfg

RUNS = [("gpt-llama", 2, 1, False), ("gpt-learned", 2, 2, True), ("gpt-llama", 2, 2, True)]


@pytest.fixture(scope="module")
def torch_checkpoints(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mcore-torch")
    runs = [(s, tp, pp, legacy, str(tmp / f"{s}-t{tp}-p{pp}-{'legacy' if legacy else 'core'}"))
            for s, tp, pp, legacy in RUNS]
    spawn(mc.torch_format_worker, 2, args=(runs, str(tmp / "losses.pt")), timeout_minutes=3)
    losses = torch.load(tmp / "losses.pt")
    return {(s, pp, legacy): (root, losses[root]) for s, tp, pp, legacy, root in runs}


@pytest.mark.parametrize("layout", [(1, 1, 1), (2, 2, 1)], ids=["t1d1w1", "t2d2w1"])
@pytest.mark.parametrize("shape,stages,legacy", [(s, pp, legacy) for s, _, pp, legacy in RUNS],
                         ids=[f"{s}-p{pp}-{'legacy' if legacy else 'core'}"
                              for s, _, pp, legacy in RUNS])
def test_a_torch_format_checkpoint_loads_with_its_loss(torch_checkpoints, tmp_path, shape,
                                                       stages, legacy, layout):
    ckpt, theirs = torch_checkpoints[shape, stages, legacy]
    got = load_and_evaluate(our_cfg(shape, *layout), ckpt, tmp_path / "got.pt")
    assert got["start"] == mc.ITERATION
    assert math.isclose(got["loss"], theirs, rel_tol=1e-5), (got["loss"], theirs)
    assert got["iteration"] == mc.ITERATION + 2
    assert any(x.startswith("optimizer state restarts: the checkpoint holds none")
               for x in got["lines"])
    assert not [x for x in got["lines"] if "left out (no parameter" in x]  # all have one


def _rewrite(root, tmp_path, change) -> str:
    """A copy of a torch-format checkpoint whose stage files `change(state, file name)` edits."""
    out = tmp_path / "variant"
    shutil.copytree(root, out)
    directory = out / f"iter_{mc.ITERATION:07d}"
    for name in sorted(os.listdir(directory)):
        path = directory / name / "model_optim_rng.pt"
        state = torch.load(path, weights_only=False)
        change(state, name)
        torch.save(state, path)
    return str(out)


def test_tensors_no_parameter_reads_are_said_in_one_line(torch_checkpoints, tmp_path):
    """What this model has no parameter for is named, not dropped silently: a legacy tensor
    of no known name, and (the untied Llama's files without their args: names and shapes
    checked only) the output layer a tied run does not have."""
    root, _ = torch_checkpoints["gpt-llama", 2, True]

    def extra(state, name):
        if name == "mp_rank_00_000":
            state["model"]["language_model"]["encoder"]["layers.0.mlp.extra.weight"] = \
                torch.zeros(2)
    ckpt = _rewrite(root, tmp_path / "legacy", extra)
    got = load_and_evaluate(our_cfg("gpt-llama", 1, 1, 1), ckpt, tmp_path / "got.pt")
    assert [x for x in got["lines"] if "left out (no parameter" in x] == [
        f"checkpoint {ckpt}/iter_{mc.ITERATION:07d}: left out (no parameter of this model): "
        "language_model.encoder.layers.0.mlp.extra.weight"]

    root, _ = torch_checkpoints["gpt-llama", 1, False]
    ckpt = _rewrite(root, tmp_path / "core", lambda state, name: state.pop("args"))
    family, argv = mc.our_flags("gpt-llama", 1, 1)
    argv.remove("--untie-embeddings-and-output-weights")
    cfg = build_config(build_parser(family).parse_args(argv), family, 1).config
    got = load_and_evaluate(cfg, ckpt, tmp_path / "got.pt")
    assert [x for x in got["lines"] if "left out (no parameter" in x] == [
        f"checkpoint {ckpt}/iter_{mc.ITERATION:07d}: left out (no parameter of this model): "
        "output_layer.weight"]


def test_the_resume_check_reads_the_first_stage_file_only(torch_checkpoints):
    """Before any process group: the layout and data position from the first stage file's args
    (its tensors are not read), and a differing architecture refused in one line."""
    from megatron_2bw.checkpoint.files import CheckpointError
    from megatron_2bw.checkpoint.resume import resume_note
    from megatron_2bw.config.build import build_config
    from megatron_2bw.pretrain import build_parser
    ckpt, _ = torch_checkpoints["gpt-learned", 2, True]
    family, argv = mc.our_flags("gpt-learned", 1, 1)
    cfg = build_config(build_parser(family).parse_args(argv + ["--load", ckpt]), family, 1).config
    note = resume_note(cfg, 1)
    assert "(Megatron torch format (Megatron legacy)) saved with t=2 d=2 w=1 flush on 4 ranks" \
        in note
    cfg = build_config(build_parser(family).parse_args(argv + ["--load", ckpt, "--swiglu"]),
                       family, 1).config
    with pytest.raises(CheckpointError, match="swiglu False .this run: True; use no --swiglu."):
        resume_note(cfg, 1)
