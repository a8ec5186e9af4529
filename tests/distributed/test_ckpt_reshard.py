"""torch_dist checkpoints move between layouts and schedules (issue 18): saved at (t=2, d=2, w=1)
with 2bw and loaded at (1, 2, 2) flush and at (1, 4, 1) 2bw, the merged fp32 weights, the 2BW
previous version and the Adam moments are bitwise equal to the saved ones, and the next
iterations equal the single-process reference started from the merged state (rtol 1e-5).

Merging here goes through the engine's own per-stage names,
`tensor_parallel.shards.merge_tensor_shards` and the tied renames, not through the checkpoint's
boxes (checkpoint/dist/shards.py), so a wrong box fails it. The same holds from a
distributed-optimizer checkpoint (--use-distributed-optimizer, saved at (1, 2, 2) 2bw, each
data-parallel rank writing its pieces of the moments: checkpoint/dist/shards.py, the pieces form)
loaded without it at (1, 2, 1) flush and with it at (2, 1, 2) 2bw, whose pieces cover other
parameters; the dumps' pieces are joined by `optim.distributed.full_state`."""
import copy
import functools
import os

import pytest
import torch

from megatron_2bw.checkpoint.api import load_checkpoint, save_checkpoint
from megatron_2bw.checkpoint.names import one_process_names
from megatron_2bw.config.build import build_config
from megatron_2bw.models.families import model_parts
from megatron_2bw.optim.distributed import full_state
from megatron_2bw.parallel.grid import ProcessGrid
from megatron_2bw.pretrain import build_parser
from megatron_2bw.tensor_parallel.shards import merge_tensor_shards
from megatron_2bw.testing.reference import build_sequential, reference_train
from megatron_2bw.testing.verify import Report, compare
from megatron_2bw.training.build import build_engine, mock_batches
from megatron_2bw.training.spawn import spawn

BASE = ("--mock-data --num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 1 --global-batch-size 8 --lr 3e-3 --vocab-size 128 "
        "--hidden-dropout 0 --attention-dropout 0").split()  # compared with a reference
SAVED_AT, MORE = 3, 2
KINDS = ("newest", "previous", "exp_avg", "exp_avg_sq")


def layout_cfg(t, d, w, schedule, extra=()):
    argv = BASE + ["--tensor-model-parallel-size", str(t), "--pipeline-model-parallel-size",
                   str(d), "--pipeline-schedule", schedule, "--train-iters",
                   str(SAVED_AT + MORE), *extra]
    return build_config(build_parser("gpt").parse_args(argv), "gpt", t * d * w).config


def _split(names, shapes, packed: torch.Tensor) -> dict[str, torch.Tensor]:
    """A state buffer (the stage's parameters back to back, no padding) by parameter name."""
    out, o = {}, 0
    for name, shape in zip(names, shapes):
        out[name] = packed[o:o + shape.numel()].view(shape).clone()
        o += shape.numel()
    return out


def _dump(engine, cfg, grid) -> dict:
    """This rank's state by its stage's parameter names (the engine's own view). A distributed
    optimizer's moments are this rank's pieces only ("pieces", copied: they are views of the
    live buffers): `unshard` fills them in."""
    state, w = engine.state_dict(), engine.weights
    split = functools.partial(_split, w.names, w.shapes)
    optimizer = state["optimizer"]
    named = {"newest": split(state["newest"]),
             "previous": split(state["previous"]) if "previous" in state else None,
             "pieces": copy.deepcopy(optimizer) if "pieces" in optimizer else None,
             "names": list(w.names), "shapes": list(w.shapes)}
    for key in ("exp_avg", "exp_avg_sq"):
        named[key] = None if named["pieces"] else split(optimizer[key])
    return {**named, "steps": optimizer["steps"], "iteration": engine.iteration,
            "partition_dims": dict(zip(w.names, w.partition_dims)),
            "renames": one_process_names(cfg, w.modules[0]),
            "stage": grid.stage, "dp": grid.dp_rank, "tp": grid.tp_rank}


def unshard(dumps: list[dict]) -> list[dict]:
    """Every rank's full moments of its stage from the pieces of its data-parallel group
    (`optim.distributed.full_state`), so that dumps of any run merge alike."""
    for x in dumps:
        if x["pieces"] is not None:
            group = [y["pieces"] for y in dumps if (y["stage"], y["tp"]) == (x["stage"], x["tp"])]
            full = full_state(group)
            for key in ("exp_avg", "exp_avg_sq"):
                x[key] = _split(x["names"], x["shapes"], full[key])
    return dumps


def _save_worker(rank, world, cfg, ckpt, out):
    grid = ProcessGrid.from_config(cfg, rank, world).init_groups()
    engine = build_engine(cfg, grid, "cpu")
    data = mock_batches(cfg, grid.data, grid.dp_rank)
    for _ in range(SAVED_AT):
        engine.train_batch(data)
    save_checkpoint(ckpt, engine, cfg, grid)
    torch.save(_dump(engine, cfg, grid), f"{out}.{rank}")


def _load_worker(rank, world, cfg, ckpt, out):
    grid = ProcessGrid.from_config(cfg, rank, world).init_groups()
    engine = build_engine(cfg, grid, "cpu")
    assert load_checkpoint(ckpt, engine, cfg, grid) == SAVED_AT
    loaded = _dump(engine, cfg, grid)
    data = mock_batches(cfg, grid.data, grid.dp_rank, start_batch=SAVED_AT)
    losses, norms = [], []
    for _ in range(MORE):
        losses.append(float(engine.train_batch(data)))
        norms.append(float(engine.last_grad_norm))
    torch.save({"loaded": loaded, "params": {k: v.clone() for k, v in
                                              engine.fp32_state().items()},
                "tied": engine.weights.modules[0].tied_parameter_names(),
                "partition_dims": loaded["partition_dims"], "stage": grid.stage,
                "dp": grid.dp_rank, "tp": grid.tp_rank, "losses": losses, "grad_norms": norms,
                "eval_losses": []}, f"{out}.{rank}")


def merged(dumps: list[dict], kind: str) -> dict[str, torch.Tensor]:
    """One full tensor per one-process name, from every stage's tensor shards of replica 0."""
    rep = Report()
    shards = [{"params": d[kind], "partition_dims": d["partition_dims"], "stage": d["stage"],
               "dp": d["dp"], "tp": d["tp"], "renames": d["renames"]}
              for d in dumps if d["dp"] == 0]
    out = {}
    for stage in merge_tensor_shards(shards, rep.problems):
        for name, value in stage["params"].items():
            out.setdefault(stage["renames"].get(name, name), value)
    assert not rep.problems, rep.problems
    return out


def _assert_bitwise(a: dict, b: dict, what: str) -> None:
    assert set(a) == set(b), (what, set(a) ^ set(b))
    bad = [n for n in a if not torch.equal(a[n], b[n])]
    assert not bad, f"{what} differs in {bad}"


def _save(tmp_path_factory, t, d, w, extra=()):
    """(checkpoint dir, the saved state merged by kind, tmp dir, the ranks' dumps) of a 2bw run
    at (t, d, w) saved after SAVED_AT iterations."""
    tmp = tmp_path_factory.mktemp("reshard")
    cfg, world = layout_cfg(t, d, w, "2bw", extra), t * d * w
    spawn(_save_worker, world, args=(cfg, str(tmp / "ckpt"), str(tmp / "saved")),
          timeout_minutes=2)
    dumps = unshard([torch.load(f"{tmp}/saved.{r}") for r in range(world)])
    return str(tmp / "ckpt"), {k: merged(dumps, k) for k in KINDS}, tmp, dumps


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return _save(tmp_path_factory, 2, 2, 1)


def check_load(saved, t, d, w, schedule, extra=()) -> list[dict]:
    """Load `saved` at (t, d, w) with `schedule`: the merged state is bitwise the saved one and
    the next MORE iterations equal the single-process reference from it (rtol 1e-5). Returns
    the loaded ranks' dumps."""
    ckpt, before, tmp, _ = saved
    cfg = layout_cfg(t, d, w, schedule, extra)
    out = str(tmp / f"loaded_{t}{d}{w}{schedule}")
    spawn(_load_worker, t * d * w, args=(cfg, ckpt, out), timeout_minutes=2)
    results = [torch.load(f"{out}.{r}") for r in range(t * d * w)]
    dumps = unshard([r["loaded"] for r in results])
    assert {x["iteration"] for x in dumps} == {SAVED_AT} and {x["steps"] for x in dumps} == {3}
    for kind in ("newest", "exp_avg", "exp_avg_sq"):
        _assert_bitwise(merged(dumps, kind), before[kind], kind)
    if schedule == "2bw":  # W(t-1) carries over; flush keeps the newest version only
        _assert_bitwise(merged(dumps, "previous"), before["previous"], "previous")
    else:
        assert all(x["previous"] is None for x in dumps)
    for kind in ("newest", "exp_avg", "exp_avg_sq"):  # the replicas loaded the same
        for x in dumps:
            for name, value in x[kind].items():
                twin = next(y for y in dumps if (y["stage"], y["tp"]) == (x["stage"], x["tp"]))
                assert torch.equal(value, twin[kind][name])

    specs, loss_fn, _ = model_parts(cfg)
    start = {"iteration": SAVED_AT, "newest": before["newest"],
             "previous": before["previous"] if schedule == "2bw" else None,
             "optimizer": {"steps": SAVED_AT, "exp_avg": before["exp_avg"],
                           "exp_avg_sq": before["exp_avg_sq"]}}
    ref_params, ref_losses, _ = reference_train(
        cfg, specs, loss_fn, lambda r: mock_batches(cfg, w, r, start_batch=SAVED_AT), MORE,
        start=start)
    ref_tied = build_sequential(cfg, specs).tied_parameter_names()
    rep = compare(cfg, results, ref_params, ref_losses, ref_tied)
    assert rep.passed(1e-5), rep
    return dumps


@pytest.mark.parametrize("t,d,w,schedule", [(1, 2, 2, "flush"), (1, 4, 1, "2bw")])
def test_a_2bw_checkpoint_of_t2_d2_loads_into_another_layout_and_schedule(saved, t, d, w,
                                                                           schedule):
    check_load(saved, t, d, w, schedule)


DISTRIBUTED = ("--use-distributed-optimizer",)


@pytest.fixture(scope="module")
def saved_distributed(tmp_path_factory):
    """A distributed-optimizer checkpoint: each data-parallel rank saves its own pieces of the
    moments (checkpoint/dist/shards.py, the pieces form)."""
    saved = _save(tmp_path_factory, 1, 2, 2, DISTRIBUTED)
    assert all(x["pieces"]["sharded"]["count"] == 2 for x in saved[3])
    return saved


@pytest.mark.parametrize("t,d,w,schedule,extra", [
    (1, 2, 1, "flush", ()), (2, 1, 2, "2bw", DISTRIBUTED),
    (1, 2, 2, "flush", DISTRIBUTED + ("--ddp-bucket-size", "3000"))],
    ids=["t1d2w1-flush", "t2d1w2-2bw-distributed", "t1d2w2-flush-distributed-buckets"])
def test_a_distributed_optimizer_checkpoint_loads_into_another_layout_and_sharding(
        saved_distributed, t, d, w, schedule, extra):
    """Saved at (1, 2, 2) 2bw with --use-distributed-optimizer: loads without it at (1, 2, 1)
    flush, and with it at (2, 1, 2) 2bw, where every rank's pieces cover other parameters, and
    at (1, 2, 2) cut into reduction buckets of 3000 parameters (one piece per bucket)."""
    dumps = check_load(saved_distributed, t, d, w, schedule, extra)
    assert all((x["pieces"] is not None) == bool(extra) for x in dumps)
    if "--ddp-bucket-size" in extra:
        assert all(len(x["pieces"]["pieces"]) >= 3 for x in dumps)


def test_the_checkpoint_reads_with_dcp_alone_as_full_tensors(saved, tmp_path):
    """The files are DCP's own: its converter gives every tensor whole, equal to the merge."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    ckpt, before, _, _ = saved
    dcp_to_torch_save(os.path.join(ckpt, f"iter_{SAVED_AT:07d}"), tmp_path / "full.pt")
    full = torch.load(tmp_path / "full.pt", weights_only=False)
    _assert_bitwise({n[len("model."):]: v for n, v in full.items() if n.startswith("model.")},
                    before["newest"], "newest")
    _assert_bitwise({n[len("optimizer.exp_avg."):]: v for n, v in full.items()
                     if n.startswith("optimizer.exp_avg.")}, before["exp_avg"], "exp_avg")
