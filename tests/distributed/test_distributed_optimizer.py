"""--use-distributed-optimizer on real gloo processes: every schedule equals its single-process
reference (tools/verify_equivalence.py: Adam, clipping active, fp32, rtol 1e-5), resume is bitwise
exact, the sharded optimizer state loads into a run without the distributed optimizer, and the
engine really holds 1/w of the master weights and optimizer state.

The default run keeps cheap cases; `-m slow` runs the matrix of issue 17: gpipe/flush/2bw x
(t, d, w) in {(1,2,2), (2,2,2), (1,2,4)}."""
import os
import tempfile

import pytest
import torch

from matrix import matrix
from megatron_2bw.checkpoint.api import LATEST, load_checkpoint, rank_dir
from megatron_2bw.checkpoint.files import optimizer_shard_name
from megatron_2bw.config.build import build_config
from megatron_2bw.optim.distributed import full_state
from megatron_2bw.parallel.grid import ProcessGrid
from megatron_2bw.pretrain import build_parser
from megatron_2bw.schedule.compensation_methods import NONE, method_names
from megatron_2bw.testing.verify import parse, run
from megatron_2bw.training.build import build_engine
from megatron_2bw.training.spawn import spawn
from torch.multiprocessing import ProcessRaisedException

from fault_hooks import PoisonGradient
from test_hf_convert import _train_worker
from test_resume import _worker as _train_with_hooks

TINY = ("--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --train-iters 4 --clip-grad 0.3 --optimizer adam "
        "--use-distributed-optimizer").split()


def check(schedule, t, d, w, *extra, eval_interval=0):
    cfg, _ = parse(["--schedule", schedule, "--tensor-model-parallel-size", str(t),
                    "--pipeline-model-parallel-size", str(d), "--data-parallel-size", str(w),
                    "--global-batch-size", str(8 * w)] + TINY + list(extra))
    assert cfg.parallel.distributed_optimizer
    rep = run(cfg, timeout_minutes=2, eval_interval=eval_interval)
    assert rep.passed(1e-5), rep
    assert rep.clipped_steps > 0, "clipping must be active for the comparison to mean anything"
    assert rep.tied_equal and rep.replicas_equal and not rep.problems


def test_2bw_matches_reference_with_evaluation_between_windows():
    check("2bw", 1, 2, 2, eval_interval=2)


@pytest.mark.slow
@pytest.mark.parametrize("t,d,w", [(1, 2, 2), (2, 2, 2), (1, 2, 4)],
                         ids=["t1d2w2", "t2d2w2", "t1d2w4"])
@pytest.mark.parametrize("schedule", ["gpipe", "flush", "2bw"])
def test_full_matrix(schedule, t, d, w):
    check(schedule, t, d, w)


# -- checkpoints ------------------------------------------------------------------------------
BASE = ("--mock-data --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --hidden-dropout 0.1 --attention-dropout 0.1 --lr 3e-3 "
        "--log-interval 1 --use-distributed-optimizer --ckpt-format torch").split()  # shard files


def make_cfg(argv, world):
    return build_config(build_parser("gpt").parse_args(BASE + argv), "gpt", world).config


def _run(cfg, world, out):
    spawn(_train_worker, world, args=(cfg, out), timeout_minutes=1)
    losses = [torch.load(f"{out}.{r}") for r in range(world)]
    assert all(x == losses[0] for x in losses)
    return losses[0]


def _shards(save_dir, d, w):
    it = int(open(os.path.join(save_dir, LATEST)).read())
    return [[torch.load(os.path.join(rank_dir(save_dir, it, 0, s, d), optimizer_shard_name(r)),
                        weights_only=True)["optimizer"] for r in range(w)] for s in range(d)]


def resume_is_bitwise(extra, d, w):
    world = d * w
    flags = extra + ["--pipeline-model-parallel-size", str(d), "--global-batch-size",
                     str(2 * max(d, 2) * w)]
    with tempfile.TemporaryDirectory() as tmp:
        full = _run(make_cfg(flags + ["--train-iters", "4", "--save", f"{tmp}/a"], world),
                    world, f"{tmp}/full")
        first = _run(make_cfg(flags + ["--train-iters", "4", "--save", f"{tmp}/b",
                                       "--exit-interval", "2"], world), world, f"{tmp}/first")
        rest = _run(make_cfg(flags + ["--train-iters", "4", "--save", f"{tmp}/b", "--load",
                                      f"{tmp}/b"], world), world, f"{tmp}/rest")
        assert first + rest == full, (first, rest, full)
        for a, b in zip(_shards(f"{tmp}/a", d, w), _shards(f"{tmp}/b", d, w)):
            for x, y in zip(a, b):  # every rank's master weights and moments, bitwise
                for p, q in zip(x["pieces"], y["pieces"]):
                    assert p.keys() == q.keys() and all(
                        torch.equal(p[k], q[k]) for k in p if k != "range")


@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16", marks=pytest.mark.slow)])
def test_resume_is_bitwise_identical(precision):
    resume_is_bitwise(["--pipeline-schedule", "2bw"] + (["--bf16"] if precision == "bf16"
                                                        else []), 1, 2)


def test_resume_from_a_torch_dist_checkpoint_is_bitwise_identical():
    """The layout-free format holds the shards' pieces as boxes of global tensors
    (checkpoint/dist/shards.py): a run with the distributed optimizer resumes from it exactly."""
    flags = ["--pipeline-schedule", "2bw", "--global-batch-size", "8", "--ckpt-format",
             "torch_dist"]
    with tempfile.TemporaryDirectory() as tmp:
        full = _run(make_cfg(flags + ["--train-iters", "4"], 2), 2, f"{tmp}/full")
        first = _run(make_cfg(flags + ["--train-iters", "4", "--save", f"{tmp}/b",
                                       "--exit-interval", "2"], 2), 2, f"{tmp}/first")
        rest = _run(make_cfg(flags + ["--train-iters", "4", "--load", f"{tmp}/b"], 2), 2,
                    f"{tmp}/rest")
        assert first + rest == full, (first, rest, full)


@pytest.mark.parametrize("method", matrix([(m,) for m in method_names() if m != NONE],
                                          default=[("predict-nesterov",)]))
def test_resume_with_2bw_compensation_is_bitwise_identical(method):
    """The newest slot holds a prediction gathered from every rank's shard: the checkpoint saves
    the real weights (show_newest's gather) and loading gathers the prediction again
    (predict-nesterov: from each rank's pieces of the kept gradient, saved and compared too)."""
    resume_is_bitwise(["--pipeline-schedule", "2bw", "--2bw-compensation", method], 1, 2)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["2bw", "flush"])
def test_resume_with_tied_stages_is_bitwise_identical(schedule):
    resume_is_bitwise(["--pipeline-schedule", schedule], 2, 2)


def _load_unsharded(rank, world_size, cfg, load_dir, out):
    grid = ProcessGrid.from_config(cfg, rank, world_size).init_groups()
    engine = build_engine(cfg, grid, "cpu")
    load_checkpoint(load_dir, engine, cfg, grid)
    assert not engine.weights.sharded
    torch.save({"optimizer": engine.optimizer.state_dict(), "stage": grid.stage},
               f"{out}.{rank}")


def test_sharded_optimizer_state_loads_without_the_distributed_optimizer():
    flags = ["--global-batch-size", "8", "--pipeline-schedule", "2bw"]
    with tempfile.TemporaryDirectory() as tmp:
        _run(make_cfg(flags + ["--train-iters", "2", "--save", f"{tmp}/a"], 2), 2, f"{tmp}/x")
        cfg = make_cfg(flags + ["--train-iters", "3", "--load", f"{tmp}/a"], 2)
        cfg = cfg.replace(parallel={"distributed_optimizer": False})
        spawn(_load_unsharded, 2, args=(cfg, f"{tmp}/a", f"{tmp}/y"), timeout_minutes=1)
        saved = _shards(f"{tmp}/a", 1, 2)
        for r in range(2):
            got = torch.load(f"{tmp}/y.{r}")
            want = full_state(saved[got["stage"]])
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(got["optimizer"][key], want[key]), key
            assert got["optimizer"]["steps"] == want["steps"] == 2


def test_a_nonfinite_gradient_in_one_shard_stops_every_rank_naming_its_stage(tmp_path):
    """The per-stage non-finite bits ride in the distributed optimizer's world all-reduce: a NaN
    that only one data-parallel rank's shard of stage 1 sees stops all four ranks alike."""
    cfg = make_cfg(["--pipeline-model-parallel-size", "2", "--global-batch-size", "8",
                    "--train-iters", "4"], 4)
    with pytest.raises(ProcessRaisedException, match=r"NumericsError: gradient norm is not finite "
                       r"at iteration 2 .* the gradients of stage 1 \(of 2\) are not finite"):
        spawn(_train_with_hooks, 4, args=(cfg, f"{tmp_path}/l", PoisonGradient(rank=3,
                                                                            iteration=2)),
              timeout_minutes=1)
