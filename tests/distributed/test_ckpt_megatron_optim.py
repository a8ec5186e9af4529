"""A Megatron checkpoint's optimizer state and RNG carry over (issue 45).

Two layouts of megatron-core's (tests/mcore_models.py), both after STEPS real steps of
megatron-core's own FP32Optimizer (torch.optim.AdamW, Megatron's two parameter groups):
- plain: the FP32Optimizer's own `sharded_state_dict` (optimizer.state.exp_avg/exp_avg_sq.<key>,
  the step as common_step), GPT-2 shape saved at t=2;
- distributed: the distributed optimizer's model-space layout `fully_reshardable`, built from
  megatron-core's ShardedTensor metadata in the form DistributedOptimizer.sharded_state_dict
  writes (its own class needs CUDA buffers): fp32 optimizer.state.param.<key> beside bf16 model
  weights, the step in param_groups; Llama shape saved at t=1.

Loaded at (1, 1, 1) and (2, 2, 1): the merged fp32 weights and Adam moments equal the
checkpoint's tensors bitwise (read with DCP alone, mapped to our names: mapping.to_ours), the
step count is the checkpoint's, and the first step equals AdamW applied to them (the single-process
reference from that state, rtol 1e-5). --no-load-optim starts the moments fresh, --finetune
starts at iteration 0, a bucket layout (dp_reshardable) restarts them with one line; the RNG
state comes back only where (t, d) matches and not with --no-load-rng."""
import math
import os

import pytest
import torch

import mcore_models as mc
from megatron_2bw.checkpoint.api import load_checkpoint
from megatron_2bw.checkpoint.megatron import mapping
from megatron_2bw.models.families import model_parts
from megatron_2bw.parallel.grid import ProcessGrid
from megatron_2bw.testing.reference import build_sequential, reference_train
from megatron_2bw.testing.verify import compare
from megatron_2bw.training.build import build_engine, mock_batches
from megatron_2bw.training.spawn import spawn
from test_ckpt_megatron import our_cfg
from test_ckpt_reshard import _dump, merged, unshard

RUNS = [("gpt-learned", 2, "plain"), ("gpt-llama", 1, "distributed"),
        ("gpt-learned", 1, "dp_reshardable")]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mcore-optim")
    runs = [(s, tp, str(tmp / f"{s}-{layout}"), layout) for s, tp, layout in RUNS]
    spawn(mc.optimizer_save_worker, 2, args=(runs, str(tmp / "losses.pt")), timeout_minutes=3)
    losses = torch.load(tmp / "losses.pt")
    return {layout: (root, losses[s, tp, layout]) for s, tp, root, layout in runs}


def expected(root: str, cfg, main_prefix: str) -> dict:
    """The checkpoint's tensors, read by DCP alone, in our names: newest (fp32 main weights),
    exp_avg, exp_avg_sq."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    directory = os.path.join(root, f"iter_{mc.ITERATION:07d}")
    dcp_to_torch_save(directory, os.path.join(root, "full.pt"))
    full = torch.load(os.path.join(root, "full.pt"), weights_only=False)
    out = {"newest": {}, "exp_avg": {}, "exp_avg_sq": {}}
    for link in mapping.links(cfg.model):
        key, layer = mapping.dist_key(link.theirs)
        for kind, prefix in (("newest", main_prefix), ("exp_avg", "optimizer.state.exp_avg."),
                             ("exp_avg_sq", "optimizer.state.exp_avg_sq.")):
            t = full[prefix + key]
            out[kind][link.ours] = mapping.to_ours(link, t if layer is None else t[layer])
    return out


def _worker(rank, world, cfg, ckpt, out, load_optim, finetune, load_rng):
    grid = ProcessGrid.from_config(cfg, rank, world).init_groups()
    engine = build_engine(cfg, grid, "cpu")
    lines = []
    start = load_checkpoint(ckpt, engine, cfg, grid, load_optim=load_optim, finetune=finetune,
                            log=lines.append, load_rng=load_rng)
    rng = torch.get_rng_state()
    loaded = _dump(engine, cfg, grid)
    loss = float(engine.eval_batch(mock_batches(cfg, grid.data, grid.dp_rank, start_batch=0)))
    data = mock_batches(cfg, grid.data, grid.dp_rank, start_batch=start)
    losses = [float(engine.train_batch(data))]
    torch.save({"loaded": loaded, "start": start, "loss": loss, "lines": lines, "rng": rng,
                "params": {k: v.clone() for k, v in engine.fp32_state().items()},
                "tied": engine.weights.modules[0].tied_parameter_names(),
                "partition_dims": loaded["partition_dims"], "stage": grid.stage,
                "dp": grid.dp_rank, "tp": grid.tp_rank, "losses": losses,
                "grad_norms": [float(engine.last_grad_norm)], "eval_losses": []}, f"{out}.{rank}")


def load(cfg, ckpt, tmp_path, load_optim=True, finetune=False, load_rng=True) -> list[dict]:
    world = cfg.parallel.tensor * cfg.parallel.pipeline * cfg.data_parallel_size
    out = str(tmp_path / "loaded")
    spawn(_worker, world, args=(cfg, ckpt, out, load_optim, finetune, load_rng),
          timeout_minutes=3)
    return [torch.load(f"{out}.{r}") for r in range(world)]


def _bitwise(a: dict, b: dict, what: str) -> None:
    assert set(a) == set(b), (what, set(a) ^ set(b))
    bad = [n for n in a if not torch.equal(a[n], b[n])]
    assert not bad, f"{what} differs in {bad}"


@pytest.mark.parametrize("layout", [(1, 1, 1), (2, 2, 1)], ids=["t1d1w1", "t2d2w1"])
@pytest.mark.parametrize("saved", ["plain", "distributed"])
def test_adam_state_and_main_weights_carry_over_and_the_first_step_is_adamw_on_them(
        checkpoints, tmp_path, saved, layout):
    shape = {"plain": "gpt-learned", "distributed": "gpt-llama"}[saved]
    ckpt, theirs = checkpoints[saved]
    cfg = our_cfg(shape, *layout)
    want = expected(ckpt, cfg, "" if saved == "plain" else "optimizer.state.param.")
    results = load(cfg, ckpt, tmp_path)
    dumps = unshard([r["loaded"] for r in results])
    assert {x["steps"] for x in dumps} == {mc.STEPS} and {r["start"] for r in results} == \
        {mc.ITERATION}
    for kind in ("newest", "exp_avg", "exp_avg_sq"):
        _bitwise(merged(dumps, kind), want[kind], kind)
    assert math.isclose(results[-1]["loss"], theirs, rel_tol=1e-5)
    if saved == "distributed":  # bf16 model weights, fp32 main ones: we continue in fp32
        assert any("saved with bf16; continuing with fp32" in x for x in results[-1]["lines"])
    specs, loss_fn, _ = model_parts(cfg)
    start = {"iteration": mc.ITERATION, "newest": want["newest"], "previous": None,
             "optimizer": {"steps": mc.STEPS, "exp_avg": want["exp_avg"],
                           "exp_avg_sq": want["exp_avg_sq"]}}
    w = cfg.data_parallel_size
    ref_params, ref_losses, _ = reference_train(
        cfg, specs, loss_fn, lambda r: mock_batches(cfg, w, r, start_batch=mc.ITERATION), 1,
        start=start)
    rep = compare(cfg, results, ref_params, ref_losses, build_sequential(cfg, specs)
                  .tied_parameter_names())
    assert rep.passed(1e-5), rep


def test_no_load_optim_and_finetune_keep_megatrons_meanings(checkpoints, tmp_path):
    ckpt, theirs = checkpoints["plain"]
    cfg = our_cfg("gpt-learned", 1, 1, 1)
    fresh = load(cfg, ckpt, tmp_path, load_optim=False)[0]
    assert fresh["start"] == mc.ITERATION and fresh["loaded"]["steps"] == 0
    assert not any(v.any() for v in fresh["loaded"]["exp_avg"].values())
    assert math.isclose(fresh["loss"], theirs, rel_tol=1e-5)
    tuned = load(cfg, ckpt, tmp_path, finetune=True)[0]
    assert tuned["start"] == 0 and tuned["loaded"]["steps"] == 0
    assert math.isclose(tuned["loss"], theirs, rel_tol=1e-5)


def test_a_bucket_layout_restarts_the_optimizer_in_one_line(checkpoints, tmp_path):
    ckpt, theirs = checkpoints["dp_reshardable"]
    got = load(our_cfg("gpt-learned", 1, 1, 1), ckpt, tmp_path)[0]
    assert got["loaded"]["steps"] == 0 and math.isclose(got["loss"], theirs, rel_tol=1e-5)
    [line] = [x for x in got["lines"] if x.startswith("optimizer state restarts: ")]
    assert "Megatron's dp_reshardable layout" in line and \
        "--dist-ckpt-optim-fully-reshardable" in line


def test_the_rng_state_comes_back_where_the_layout_matches(checkpoints, tmp_path):
    """Saved at t=2 d=1: a t=2 d=1 run gets each tensor rank's torch RNG state back (the saver
    seeded rank r with 1000 + r), another layout and --no-load-rng keep their own."""
    ckpt, _ = checkpoints["plain"]
    saved = [torch.manual_seed(1000 + r).get_state() for r in range(2)]
    same = load(our_cfg("gpt-learned", 2, 1, 1), ckpt, tmp_path)
    assert all(torch.equal(x["rng"], saved[x["tp"]]) for x in same)
    for cfg, load_rng in ((our_cfg("gpt-learned", 2, 1, 1), False),
                          (our_cfg("gpt-learned", 1, 1, 1), True)):
        for x in load(cfg, ckpt, tmp_path, load_rng=load_rng):
            assert not torch.equal(x["rng"], saved[x["tp"]])
