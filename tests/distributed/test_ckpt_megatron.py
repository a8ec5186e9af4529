"""Megatron-LM checkpoints load and continue here (issue 45): megatron-core's own GPTModel and
BertModel (tests/mcore_models.py: local layer spec, use_cpu_initialization, gloo) saved with its
`dist_checkpointing.save` at (t, d) = (1, 1) and (2, 1) load at (t, d, w) = (1, 1, 1), (2, 2, 1)
and (1, 2, 2); the loss on a fixed batch (samples 0..3 of the mock data) equals megatron-core's
forward loss on that batch within 1e-5 (fp32), and training continues from the checkpoint's
iteration. Shapes: learned positions + LayerNorm + GeLU + tied (GPT-2); RoPE + RMSNorm + SwiGLU +
GQA + untied without biases (Llama); BERT with its binary head; SwiGLU with biases and
--kv-channels 16 (untied, learned); --qk-layernorm with RoPE, RMSNorm, GQA and --kv-channels 16
(tied). Each megatron-core checkpoint is built once per module. (--apply-layernorm-1p: megatron-
core's CPU norms refuse zero-centred gamma; the map is the identity, tests/unit/
test_megatron_mapping.py.)"""
import math
import shutil

import pytest
import torch

import mcore_models as mc
from megatron_2bw.checkpoint.api import load_checkpoint
from megatron_2bw.config.build import build_config
from megatron_2bw.parallel.grid import ProcessGrid
from megatron_2bw.pretrain import build_parser
from megatron_2bw.training.build import build_engine, mock_batches
from megatron_2bw.training.spawn import spawn

LAYOUTS = [(1, 1, 1), (2, 2, 1), (1, 2, 2)]
SAVED = [("gpt-learned", 1), ("gpt-learned", 2), ("gpt-llama", 1), ("gpt-llama", 2),
         ("bert", 1), ("bert", 2), ("gpt-swiglu-bias", 2), ("gpt-qk", 2)]


def our_cfg(shape, t, d, w, extra=()):
    family, argv = mc.our_flags(shape, t, d)
    return build_config(build_parser(family).parse_args(argv + list(extra)), family,
                        t * d * w).config


@pytest.fixture(scope="module")
def megatron_checkpoints(tmp_path_factory):
    """(shape, saved tp) -> (checkpoint dir, megatron-core's loss on the fixed batch)."""
    tmp = tmp_path_factory.mktemp("mcore")
    runs = [(shape, tp, str(tmp / f"{shape}-t{tp}")) for shape, tp in SAVED]
    spawn(mc.save_worker, 2, args=(runs, str(tmp / "losses.pt")), timeout_minutes=3)
    losses = torch.load(tmp / "losses.pt")
    return {(shape, tp): (root, losses[shape, tp]) for shape, tp, root in runs}


def _load_worker(rank, world, cfg, ckpt, out):
    grid = ProcessGrid.from_config(cfg, rank, world).init_groups()
    engine = build_engine(cfg, grid, "cpu")
    lines = []
    start = load_checkpoint(ckpt, engine, cfg, grid, log=lines.append)
    loss = float(engine.eval_batch(mock_batches(cfg, grid.data, grid.dp_rank, start_batch=0)))
    data = mock_batches(cfg, grid.data, grid.dp_rank, start_batch=start)
    trained = [float(engine.train_batch(data)) for _ in range(2)]
    if rank == world - 1:
        torch.save({"start": start, "loss": loss, "trained": trained, "iteration":
                    engine.iteration, "lines": lines}, out)


def load_and_evaluate(cfg, ckpt, out) -> dict:
    world = cfg.parallel.tensor * cfg.parallel.pipeline * cfg.data_parallel_size
    spawn(_load_worker, world, args=(cfg, ckpt, str(out)), timeout_minutes=3)
    return torch.load(out)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: "t{}d{}w{}".format(*x))
@pytest.mark.parametrize("shape,tp", SAVED, ids=[f"{s}-saved-t{t}" for s, t in SAVED])
def test_a_megatron_core_checkpoint_loads_with_its_loss_and_continues(
        megatron_checkpoints, tmp_path, shape, tp, layout):
    ckpt, theirs = megatron_checkpoints[shape, tp]
    got = load_and_evaluate(our_cfg(shape, *layout), ckpt, tmp_path / "got.pt")
    assert got["start"] == mc.ITERATION
    assert math.isclose(got["loss"], theirs, rel_tol=1e-5), (got["loss"], theirs)
    assert got["iteration"] == mc.ITERATION + 2 and all(map(math.isfinite, got["trained"]))
    assert any("not written by megatron-2bw: files not verified" in x for x in got["lines"])
    assert not [x for x in got["lines"] if "left out (no parameter" in x]  # all have one


def test_a_tensor_no_parameter_reads_is_said_in_one_line(megatron_checkpoints, tmp_path):
    """The untied Llama checkpoint without its args (dist_checkpointing.save of a model alone:
    only names and shapes are checked) loaded by a tied run: its output_layer.weight has no
    parameter here, which is said, not dropped silently."""
    ckpt, _ = megatron_checkpoints["gpt-llama", 1]
    out = tmp_path / "bare"
    shutil.copytree(ckpt, out)
    path = out / f"iter_{mc.ITERATION:07d}" / "common.pt"
    torch.save({"iteration": torch.load(path, weights_only=False)["iteration"]}, path)
    family, argv = mc.our_flags("gpt-llama", 1, 1)
    argv.remove("--untie-embeddings-and-output-weights")
    cfg = build_config(build_parser(family).parse_args(argv), family, 1).config
    got = load_and_evaluate(cfg, str(out), tmp_path / "got.pt")
    assert [x for x in got["lines"] if "left out (no parameter" in x] == [
        f"checkpoint {path.parent}: left out (no parameter of this model): output_layer.weight"]
