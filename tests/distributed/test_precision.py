"""bf16 / fp16 through the pipeline: fp32 master weights, fp16 loss scaling that skips a step
consistently on every rank, and a 2BW state that stays consistent after a skipped step."""
import os
import tempfile

import pytest
import torch

from megatron_2bw.parallel.grid import ProcessGrid
from megatron_2bw.testing.verify import parse, run
from megatron_2bw.training.build import build_engine, mock_batches
from megatron_2bw.training.spawn import spawn

TINY = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --global-batch-size 16 --train-iters 5 --data-parallel-size 2 "
        "--pipeline-model-parallel-size 2 --optimizer sgd --lr 0.05").split()


@pytest.mark.parametrize("precision,rtol,extra", [
    ("--bf16", 3e-2, []), ("--fp16", 1e-2, []),
    ("--bf16", 3e-2, ["--use-distributed-optimizer"])], ids=["bf16", "fp16", "bf16-distopt"])
def test_mixed_precision_2bw_tracks_fp32_reference(precision, rtol, extra):
    # SGD keeps the comparison meaningful: Adam normalizes away the gradient's scale, so
    # low-precision rounding in tiny gradients would flip update signs of those elements.
    cfg, _ = parse(["--schedule", "2bw", precision] + TINY + extra)
    rep = run(cfg, timeout_minutes=1)
    assert rep.passed(rtol), rep
    assert rep.max_loss_diff < 1e-4


def _fp16_worker(rank, world_size, cfg, outdir):
    grid = ProcessGrid.from_config(cfg, rank, world_size).init_groups()
    engine = build_engine(cfg, grid, "cpu")
    data = mock_batches(cfg, grid.data, grid.dp_rank)
    engine.start(cfg.train.train_iters)
    losses, scales = [], []
    for _ in range(cfg.train.train_iters):
        losses.append(float(engine.train_batch(data)))
        scales.append(engine.stepper.scaler.scale)
    torch.save({"skipped": engine.skipped_iterations, "losses": losses, "scales": scales,
                "stage": grid.stage, "dp": grid.dp_rank,
                "tied": {k: engine.fp32_state()[n].clone()
                         for k, n in engine.module.tied_parameter_names().items()},
                "slots": [s.clone() for s in engine.weights.slots],
                "master": engine.weights.master.clone()},
               os.path.join(outdir, f"{rank}.pt"))


@pytest.mark.parametrize("extra", [[], ["--use-distributed-optimizer"]], ids=["", "distopt"])
def test_fp16_overflow_skips_consistently_on_every_rank(extra):
    """(With the distributed optimizer each rank's master is its shard, and the replicas'
    weight versions must still be bitwise alike after the skips.)"""
    cfg, _ = parse(["--schedule", "2bw", "--fp16", "--initial-loss-scale", str(2.0 ** 24),
                    "--hysteresis", "1"] + TINY[:-4] + ["--train-iters", "8"] + extra)
    assert cfg.parallel.distributed_optimizer == bool(extra)
    with tempfile.TemporaryDirectory() as d:
        spawn(_fp16_worker, 4, args=(cfg, d), timeout_minutes=1)
        res = [torch.load(os.path.join(d, f"{r}.pt")) for r in range(4)]
    skipped = {r["skipped"] for r in res}
    assert len(skipped) == 1 and 0 < skipped.pop() < 8, "every rank skips the same steps"
    assert all(r["scales"] == res[0]["scales"] for r in res)
    assert res[0]["scales"][-1] < 2.0 ** 24
    assert all(r["losses"] == res[0]["losses"] for r in res), "loss is the same on every rank"
    assert all(torch.isfinite(torch.tensor(r["losses"])).all() for r in res)
    for r in res:
        assert torch.isfinite(r["master"]).all()
        for slot in r["slots"]:
            assert torch.isfinite(slot.float()).all()
    by_dp = {}
    for r in res:
        for key, value in r["tied"].items():
            by_dp.setdefault((r["dp"], key), []).append(value)
    for copies in by_dp.values():
        assert len(copies) == 2 and torch.equal(copies[0], copies[1])
    for a in res:  # data-parallel replicas of a stage hold the same versions
        for b in res:
            if a["stage"] == b["stage"]:
                assert all(torch.equal(x, y) for x, y in zip(a["slots"], b["slots"]))
