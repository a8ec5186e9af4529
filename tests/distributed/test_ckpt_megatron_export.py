"""Ours back into Megatron (issue 45): `--ckpt-format megatron` saves and `tools/
checkpoint_convert.py to-megatron` write megatron-core's torch_dist format
(checkpoint/megatron/export.py).

- ours -> megatron -> ours is bitwise: a 2bw run at (t, d, w) = (2, 2, 1), saved with
  --ckpt-format megatron or converted from its torch_dist save, loads at (1, 2, 2) flush and
  (1, 4, 1) 2bw with the fp32 weights, 2BW's previous version and Adam's moments bitwise the
  saved ones, and continues as the single-process reference (test_ckpt_reshard's check_load);
  the same from a distributed-optimizer run.
- megatron-core reads our export: its own GPTModel / BertModel, loaded with
  dist_checkpointing.load, gives our loss on the fixed batch within 1e-5, its FP32Optimizer
  loads Adam's moments equal to ours, and common.pt holds what Megatron-LM's load_checkpoint
  reads (args, checkpoint_version, iteration, opt_param_scheduler, ...)."""
import os

import pytest
import torch

import mcore_models as mc
from megatron_2bw.checkpoint.convert.cli import main as convert_main
from megatron_2bw.training.spawn import spawn
from test_ckpt_reshard import SAVED_AT, _save, check_load

MEGATRON = ("--ckpt-format", "megatron")


@pytest.fixture(scope="module")
def saved_megatron(tmp_path_factory):
    ckpt, merged, tmp, dumps = _save(tmp_path_factory, 2, 2, 1, MEGATRON)
    assert os.path.isfile(os.path.join(ckpt, f"iter_{SAVED_AT:07d}", "metadata.json"))
    return ckpt, merged, tmp, dumps


@pytest.mark.parametrize("t,d,w,schedule", [(1, 2, 2, "flush"), (1, 4, 1, "2bw")])
def test_a_megatron_format_save_loads_back_bitwise(saved_megatron, t, d, w, schedule):
    check_load(saved_megatron, t, d, w, schedule)


def test_to_megatron_of_a_torch_dist_checkpoint_loads_back_bitwise(tmp_path_factory):
    ckpt, merged, tmp, dumps = _save(tmp_path_factory, 2, 2, 1)
    out = tmp / "megatron"
    from inprocess import run_main
    proc = run_main(convert_main, ["to-megatron", "--load", ckpt, "--save", out])
    assert proc.returncode == 0, proc.stderr
    assert "in megatron-core's torch_dist format" in proc.stdout
    check_load((str(out), merged, tmp, dumps), 1, 2, 2, "flush")


def test_a_distributed_optimizer_run_saved_for_megatron_loads_back_bitwise(tmp_path_factory):
    saved = _save(tmp_path_factory, 1, 2, 2, MEGATRON + ("--use-distributed-optimizer",))
    check_load(saved, 2, 1, 2, "2bw", ("--use-distributed-optimizer",))


def _our_worker(rank, world, cfg, ckpt, out):
    """Train our run STEPS steps, save it (--ckpt-format megatron), write our batch loss and our
    Adam moments by one-process name."""
    from megatron_2bw.checkpoint.api import save_checkpoint
    from megatron_2bw.parallel.grid import ProcessGrid
    from megatron_2bw.training.build import build_engine, mock_batches
    from test_ckpt_reshard import _dump
    grid = ProcessGrid.from_config(cfg, rank, world).init_groups()
    engine = build_engine(cfg, grid, "cpu")
    data = mock_batches(cfg, grid.data, grid.dp_rank)
    for _ in range(mc.STEPS):
        engine.train_batch(data)
    save_checkpoint(ckpt, engine, cfg, grid)
    loss = float(engine.eval_batch(mock_batches(cfg, grid.data, grid.dp_rank, start_batch=0)))
    torch.save({"loss": loss, "dump": _dump(engine, cfg, grid)}, f"{out}.{rank}")


@pytest.mark.parametrize("shape,layout,mcore_tp", [("gpt-learned", (2, 2, 1), 1),
                                                  ("gpt-llama", (1, 2, 1), 2),
                                                  ("bert", (1, 1, 1), 2)])
def test_megatron_core_loads_our_export(tmp_path, shape, layout, mcore_tp):
    from megatron_2bw.checkpoint.megatron import mapping
    from test_ckpt_megatron import our_cfg
    from test_ckpt_reshard import merged, unshard
    t, d, w = layout
    cfg = our_cfg(shape, t, d, w, ["--ckpt-format", "megatron", "--train-iters", "10"])
    ckpt = str(tmp_path / "ours")
    spawn(_our_worker, t * d * w, args=(cfg, ckpt, str(tmp_path / "ours.pt")),
          timeout_minutes=3)
    ours = [torch.load(f"{tmp_path}/ours.pt.{r}") for r in range(t * d * w)]
    directory = os.path.join(ckpt, f"iter_{mc.STEPS:07d}")
    spawn(mc.load_export_worker, mcore_tp, args=(shape, mcore_tp, directory,
                                                 str(tmp_path / "mcore.pt")), timeout_minutes=3)
    got = torch.load(tmp_path / "mcore.pt", weights_only=False)
    assert abs(got["loss"] - ours[-1]["loss"]) <= 1e-5 * abs(ours[-1]["loss"])
    assert got["common"]["iteration"] == mc.STEPS and got["common"]["checkpoint_version"] == 3.0
    assert got["common"]["opt_param_scheduler"]["num_steps"] == mc.STEPS * mc.BATCH
    assert got["args"]["num_layers"] == mc.LAYERS and got["args"]["tensor_model_parallel_size"] \
        == t and got["args"]["consumed_train_samples"] == mc.STEPS * mc.BATCH
    if mcore_tp == 1:  # megatron-core's moments (whole tensors) equal ours
        dumps = unshard([x["dump"] for x in ours])
        for kind in ("exp_avg", "exp_avg_sq"):
            mine = merged(dumps, kind)
            for link in mapping.links(cfg.model):
                theirs = got["moments"][link.theirs]
                assert torch.equal(mapping.to_ours(link, theirs[kind]), mine[link.ours]), \
                    (kind, link.ours)
                assert theirs["step"] == mc.STEPS


def test_an_asynchronous_megatron_format_save_resumes_bitwise(tmp_path):
    """--async-save with --ckpt-format megatron: written in the background from host copies of
    the translated boxes while training goes on; loading it gives the state at the save."""
    from megatron_2bw.checkpoint.api import load_checkpoint
    from megatron_2bw.checkpoint.saver import Checkpointer
    from megatron_2bw.training.build import mock_batches
    from test_ckpt_async import _one_rank
    engine, cfg, grid = _one_rank(["--save", str(tmp_path), "--async-save", *MEGATRON])
    saver = Checkpointer(cfg, grid, engine)
    data = mock_batches(cfg, 1, 0)
    for _ in range(2):
        engine.train_batch(data)
    saved = {k: v.clone() for k, v in engine.state_dict().items() if torch.is_tensor(v)}
    saver.save()
    for _ in range(2):  # the engine changes its buffers while the write goes on
        engine.train_batch(data)
    saver.wait()
    assert os.path.isfile(tmp_path / "iter_0000002" / "metadata.json")
    fresh, _, _ = _one_rank(["--save", str(tmp_path)])
    assert load_checkpoint(str(tmp_path), fresh, cfg, grid) == 2
    back = fresh.state_dict()
    assert all(torch.equal(back[k], v) for k, v in saved.items())
