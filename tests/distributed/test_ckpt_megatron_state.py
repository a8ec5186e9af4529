"""What a Megatron checkpoint carries besides the weights (issue 45): the iteration and the data
position (args.consumed_train_samples), the lr scheduler's state (opt_param_scheduler: megatron-
core's own OptimizerParamScheduler), and the architecture in its args, all checked before any
process group (checkpoint/resume.py): a setting that differs is refused in one line naming both
values and the flag that matches; --override-opt_param-scheduler and --finetune keep Megatron's
meanings. The checkpoint is megatron-core's own (tests/mcore_models.py); the variants rewrite
its common.pt as Megatron would have written it with other arguments."""
import argparse
import os
import shutil

import pytest
import torch

import mcore_models as mc
from megatron_2bw.checkpoint.files import CheckpointError
from megatron_2bw.checkpoint.resume import resume_note, saved_config
from megatron_2bw.config.build import build_config
from megatron_2bw.pretrain import build_parser
from megatron_2bw.training.spawn import spawn


@pytest.fixture(scope="module")
def megatron_checkpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mcore-state")
    spawn(mc.save_worker, 1, args=([("gpt-learned", 1, str(tmp / "ckpt"))],
                                   str(tmp / "losses.pt")), timeout_minutes=3)
    return str(tmp / "ckpt")


def cfg_for(ckpt, *extra, shape="gpt-learned", t=1, d=1, w=1):
    family, argv = mc.our_flags(shape, t, d)
    return build_config(build_parser(family).parse_args(argv + ["--load", ckpt, *extra]),
                        family, t * d * w).config


def variant(ckpt, tmp_path, **changes):
    """A copy of the checkpoint whose common.pt Megatron wrote with other values: args entries
    (keyword = value) and `scheduler` / `iteration` entries."""
    out = tmp_path / "variant"
    shutil.copytree(ckpt, out)
    path = out / f"iter_{mc.ITERATION:07d}" / "common.pt"
    state = torch.load(path, weights_only=False)
    sched = changes.pop("scheduler", {})
    state["opt_param_scheduler"].update(sched)
    args = dict(vars(state["args"]), **changes)
    state["args"] = argparse.Namespace(**args)
    torch.save(state, path)
    return str(out)


def refusal(cfg) -> str:
    with pytest.raises(CheckpointError) as e:
        resume_note(cfg, 1)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_a_matching_megatron_checkpoint_resumes_at_its_iteration(megatron_checkpoint):
    # saved by megatron-core (1F1B) at t=1 d=1 w=1: nothing changes for a flush run there
    assert resume_note(cfg_for(megatron_checkpoint), 1) is None
    note = resume_note(cfg_for(megatron_checkpoint, "--pipeline-model-parallel-size", "2",
                               "--pipeline-schedule", "2bw", d=2), 2)
    assert f"resuming iteration {mc.ITERATION} of --load {megatron_checkpoint} " \
           "(megatron-core torch_dist) saved with t=1 d=1 w=1 flush" in note
    assert f"2bw's first batch runs on W({mc.ITERATION})" in note


@pytest.mark.parametrize("flags,theirs", [
    (["--num-layers", "3"], "num_layers 2 (this run: 3; use --num-layers 2)"),
    (["--norm-epsilon", "1e-6"], "layernorm_epsilon 1e-05 (this run: 1e-06; use --norm-epsilon "
                                 "1e-05)"),
    (["--swiglu", "--ffn-hidden-size", "128"], "swiglu False (this run: True; use no --swiglu)"),
    (["--openai-gelu"], "openai_gelu False (this run: True; use no --openai-gelu)"),
    (["--untie-embeddings-and-output-weights"], "untie_embeddings_and_output_weights False"),
], ids=["layers", "epsilon", "swiglu", "gelu", "untied"])
def test_an_architecture_argument_that_differs_is_refused_in_one_line(megatron_checkpoint, flags,
                                                                      theirs):
    msg = refusal(cfg_for(megatron_checkpoint, *flags))
    assert msg.startswith(f"--load {megatron_checkpoint} (a Megatron checkpoint, iteration "
                          f"{mc.ITERATION}) differs from this run: ")
    assert theirs in msg


def test_megatrons_fused_bias_gelu_is_the_tanh_approximation(megatron_checkpoint, tmp_path):
    """Megatron's default --bias-gelu-fusion computes GeLU as tanh-approximated: only
    --openai-gelu computes what that checkpoint was trained with."""
    ckpt = variant(megatron_checkpoint, tmp_path, bias_gelu_fusion=True)
    assert "openai_gelu True (this run: False; use --openai-gelu)" in refusal(cfg_for(ckpt))
    assert resume_note(cfg_for(ckpt, "--openai-gelu"), 1) is None


def test_a_padded_vocabulary_that_differs_is_named(megatron_checkpoint, tmp_path):
    """Megatron pads the vocabulary for its tensor size (padded_vocab_size): a run padding it
    otherwise would compute other logits (the padded rows count in the softmax)."""
    ckpt = variant(megatron_checkpoint, tmp_path, padded_vocab_size=256)
    assert "vocab_size 256 (this run: 128; use --vocab-size (the padded vocabulary) 256)" in \
        refusal(cfg_for(ckpt))


def test_features_this_project_lacks_are_named(megatron_checkpoint, tmp_path):
    ckpt = variant(megatron_checkpoint, tmp_path, num_experts=8)
    assert "it uses --num-experts 8 (mixture of experts), which this project does not build" \
        in refusal(cfg_for(ckpt))


def test_the_lr_schedule_must_match_unless_overridden(megatron_checkpoint):
    msg = refusal(cfg_for(megatron_checkpoint, "--lr", "2e-3"))
    assert "max_lr 0.001 (this run: 0.002; use --lr 0.001), or --override-opt_param-scheduler " \
           "to keep this run's" in msg
    msg = refusal(cfg_for(megatron_checkpoint, "--lr-warmup-iters", "3"))
    assert "lr_warmup_steps 8 (this run: 12; use --lr-warmup-iters 2)" in msg
    for ok in (["--lr", "2e-3", "--override-opt_param-scheduler"], ["--lr", "2e-3", "--finetune"]):
        resume_note(cfg_for(megatron_checkpoint, *ok), 1)


def test_the_data_position_must_survive(megatron_checkpoint, tmp_path):
    ckpt = variant(megatron_checkpoint, tmp_path, consumed_train_samples=mc.ITERATION * 8)
    msg = refusal(cfg_for(ckpt))
    assert f"consumed {mc.ITERATION * 8} samples in {mc.ITERATION} iterations (global batch 8)" \
        in msg and msg.endswith("use --global-batch-size 8")


def test_use_checkpoint_args_takes_the_model_from_megatrons_args(megatron_checkpoint):
    it, saved = saved_config(megatron_checkpoint)
    assert it == mc.ITERATION
    model = saved["model"]
    assert (model["num_layers"], model["hidden_size"], model["vocab_size"],
            model["position_embedding_type"]) == (mc.LAYERS, mc.HIDDEN, mc.VOCAB,
                                                  "learned_absolute")


def test_an_unknown_directory_is_one_line(tmp_path):
    root = tmp_path / "ckpt"
    (root / "iter_0000003").mkdir(parents=True)
    (root / "iter_0000003" / "weights.bin").write_bytes(b"x")
    (root / "latest_checkpointed_iteration.txt").write_text("3")
    with pytest.raises(CheckpointError) as e:
        resume_note(cfg_for(str(root)), 1)
    assert "is in no format this project reads (it holds weights.bin" in str(e.value)
    assert os.listdir(root / "iter_0000003") == ["weights.bin"]


def test_a_checkpoint_without_args_loads_and_says_what_was_checked(megatron_checkpoint,
                                                                   tmp_path):
    """dist_checkpointing.save of a model alone (no Megatron-LM around it) records no args:
    only the tensors' names and shapes are checked, said in one line, and it loads."""
    from test_ckpt_megatron import load_and_evaluate
    out = tmp_path / "bare"
    shutil.copytree(megatron_checkpoint, out)
    path = out / f"iter_{mc.ITERATION:07d}" / "common.pt"
    state = torch.load(path, weights_only=False)
    torch.save({"iteration": state["iteration"]}, path)
    resume_note(cfg_for(str(out)), 1)  # no data position to check: the iterations' samples
    got = load_and_evaluate(cfg_for(str(out)), str(out), tmp_path / "got.pt")
    assert got["start"] == mc.ITERATION
    assert any("records no Megatron args: only its tensors' names and shapes are checked" in x
               for x in got["lines"])


# -- fp16: Megatron's dynamic loss scale (its optimizer's grad_scaler) --------------------------
WINDOW, HYSTERESIS = 4, 2


def megatron_grad_scaler(found_infs):
    """megatron-core's own DynamicGradScaler (its CUDA tensors made on the CPU: test stub) after
    `found_infs` updates."""
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler
    real = torch.tensor
    torch.tensor = lambda *a, device=None, **k: real(*a, **k)
    try:
        scaler = DynamicGradScaler(initial_scale=2.0 ** 16, min_scale=1.0, growth_factor=2.0,
                                   backoff_factor=0.5, growth_interval=WINDOW,
                                   hysteresis=HYSTERESIS)
    finally:
        torch.tensor = real
    for found_inf in found_infs:
        scaler.update(found_inf)
    return scaler


def _scaler_worker(rank, world, cfg, ckpt, out, load_optim):
    from megatron_2bw.checkpoint.api import load_checkpoint
    from megatron_2bw.parallel.grid import ProcessGrid
    from megatron_2bw.training.build import build_engine
    grid = ProcessGrid.from_config(cfg, rank, world).init_groups()
    engine = build_engine(cfg, grid, "cpu")
    load_checkpoint(ckpt, engine, cfg, grid, load_optim=load_optim)
    torch.save(engine.stepper.scaler.state_dict(), out)


def fp16_checkpoint(megatron_checkpoint, tmp_path, fmt: str, grad_scaler: dict) -> str:
    """The GPT-2 checkpoint as an fp16 run of Megatron saves it: args.fp16 and its optimizer's
    grad_scaler beside the optimizer (common.pt), or the same in Megatron's torch format (a
    model_optim_rng.pt of megatron-core's model: tests/mcore_models.py)."""
    if fmt == "torch_dist":
        ckpt = variant(megatron_checkpoint, tmp_path, fp16=True)
        path = os.path.join(ckpt, f"iter_{mc.ITERATION:07d}", "common.pt")
    else:
        ckpt = str(tmp_path / "torch-format")
        spawn(mc.torch_format_worker, 1, args=([("gpt-learned", 1, 1, False, ckpt)],
                                               str(tmp_path / "losses.pt")), timeout_minutes=2)
        path = os.path.join(ckpt, f"iter_{mc.ITERATION:07d}", "mp_rank_00", "model_optim_rng.pt")
    state = torch.load(path, weights_only=False)
    state["args"] = argparse.Namespace(**dict(vars(state["args"]), fp16=True))
    state["optimizer"] = {"optimizer": {"param_groups": [], "state": {}},
                          "grad_scaler": grad_scaler}
    torch.save(state, path)
    return ckpt


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
def test_an_fp16_runs_dynamic_loss_scale_carries_over(megatron_checkpoint, tmp_path, fmt):
    """Megatron's fp16 optimizer saves its DynamicGradScaler with the optimizer's state: loaded,
    ours holds its scale and trackers and the next overflows and clean steps move both alike;
    --no-load-optim starts the scale fresh, as Megatron then skips the optimizer's state."""
    from megatron_2bw.optim.loss_scale import DynamicLossScaler
    history = [True, False, True, True, False, False, False]  # two halvings, clean steps after
    theirs = megatron_grad_scaler(history)
    ckpt = fp16_checkpoint(megatron_checkpoint, tmp_path, fmt, theirs.state_dict())
    cfg = cfg_for(ckpt, "--fp16", "--initial-loss-scale", "1024", "--loss-scale-window",
                  str(WINDOW), "--hysteresis", str(HYSTERESIS))
    got = {}
    for load_optim in (True, False):
        spawn(_scaler_worker, 1, args=(cfg, ckpt, str(tmp_path / "s.pt"), load_optim),
              timeout_minutes=2)
        got[load_optim] = torch.load(tmp_path / "s.pt")
    saved = theirs.state_dict()  # Megatron's names for the same counters
    assert got[True] == {"scale": float(saved["scale"]), "clean": saved["growth_tracker"],
                         "tracker": saved["hysteresis_tracker"]} and got[True]["scale"] < 2 ** 16
    assert got[False]["scale"] == 1024.0
    ours = DynamicLossScaler(1024.0, 1.0, WINDOW, HYSTERESIS)
    ours.load_state_dict(got[True])
    for found_inf in [False, True, False, False, False, False, True, True]:
        theirs.update(found_inf)
        ours.update(found_inf)
        assert ours.scale == float(theirs.scale), (ours.scale, float(theirs.scale))
