"""torch_dist checkpoints of `--2bw-compensation predict-nesterov`, whose optimizer keeps its latest
gradient (`optimizer.last_grad.<name>`, checkpoint/dist/shards.py): it loads bitwise into another
layout (d=2 -> d=1) and into the distributed optimizer's pieces (w=2); a checkpoint without it
(another method's, an older one) loads with last_grad = exp_avg, so the first prediction is bitwise
`predict`'s; a checkpoint with it loads into a run that keeps none (the key is ignored).
Bitwise resume of the method itself: tests/distributed/test_resume.py,
tests/distributed/test_distributed_optimizer.py."""
import os

import torch

from megatron_2bw.checkpoint.api import LATEST, load_checkpoint
from megatron_2bw.checkpoint.dist.load import read_full, stage_boxes
from megatron_2bw.checkpoint.files import iteration_dir
from megatron_2bw.config.build import build_config
from megatron_2bw.optim.distributed import full_state
from megatron_2bw.parallel.grid import ProcessGrid
from megatron_2bw.pretrain import build_parser
from megatron_2bw.training.build import build_engine
from megatron_2bw.training.spawn import spawn

from test_resume import _worker as _train_worker

BASE = ("--mock-data --num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --pipeline-schedule 2bw "
        "--ckpt-format torch_dist --train-iters 6").split()


def cfg_of(method, d, w, *extra):
    argv = BASE + ["--2bw-compensation", method, "--pipeline-model-parallel-size", str(d),
                   *extra]
    return build_config(build_parser("gpt").parse_args(argv), "gpt", d * w).config


def _load_worker(rank, world_size, cfg, load_dir, out):
    """Load the checkpoint and dump this rank's optimizer state, where its flat buffers' global
    tensors lie, and the newest slot (what the next batch but one runs on: the prediction)."""
    grid = ProcessGrid.from_config(cfg, rank, world_size).init_groups()
    engine = build_engine(cfg, grid, "cpu")
    load_checkpoint(load_dir, engine, cfg, grid)
    engine.stepper.wait_weights()
    w = engine.weights
    state = engine.optimizer.state_dict()
    torch.save({"stage": grid.stage, "optimizer": state,
                "params": [(p.name, p.flat_offset, p.local_shape)
                           for p in stage_boxes(engine, cfg, grid).params],
                "slot": w.pack(w.slots[engine.kind.newest_slot(engine.iteration)]).clone()},
               f"{out}.{rank}")


def loaded(cfg, load_dir, out) -> list[dict]:
    world = cfg.parallel.pipeline * cfg.data_parallel_size
    spawn(_load_worker, world, args=(cfg, load_dir, out), timeout_minutes=1)
    return [torch.load(f"{out}.{r}") for r in range(world)]


def by_name(dumps: list[dict], key: str) -> dict[str, torch.Tensor]:
    """Optimizer buffer `key` by global tensor name, every stage's ranks joined (full_state)."""
    out = {}
    for stage in {d["stage"] for d in dumps}:
        ranks = [d for d in dumps if d["stage"] == stage]
        flat = full_state([d["optimizer"] for d in ranks])
        if key not in flat:
            continue
        for name, offset, shape in ranks[0]["params"]:
            n = torch.Size(shape).numel()
            out[name] = flat[key][offset:offset + n].view(shape)
    return out


def saved_dir(root):
    return iteration_dir(root, int(open(os.path.join(root, LATEST)).read()))


def test_the_kept_gradient_loads_into_another_layout_and_is_ignored_without_the_method(tmp_path):
    spawn(_train_worker, 2, args=(cfg_of("predict-nesterov", 2, 1, "--save", f"{tmp_path}/a",
                                         "--exit-interval", "3"), f"{tmp_path}/x"),
          timeout_minutes=1)
    directory = saved_dir(f"{tmp_path}/a")
    saved = read_full(directory, "optimizer.last_grad.")
    momentum = read_full(directory, "optimizer.exp_avg.")
    assert saved and set(saved) == set(momentum)
    assert not all(torch.equal(saved[n], momentum[n]) for n in saved), "a gradient, not m"
    for extra in ((), ("--use-distributed-optimizer",)):  # d=1: flat, and in w=2's pieces
        got = by_name(loaded(cfg_of("predict-nesterov", 1, 2, *extra), f"{tmp_path}/a",
                             f"{tmp_path}/n"), "last_grad")
        assert set(got) == set(saved), extra
        for name, value in saved.items():
            assert torch.equal(got[name], value), (extra, name)
    plain = loaded(cfg_of("predict", 2, 1), f"{tmp_path}/a", f"{tmp_path}/p")
    assert by_name(plain, "last_grad") == {} and by_name(plain, "exp_avg").keys() == saved.keys()
    for name, value in by_name(plain, "exp_avg").items():
        assert torch.equal(value, momentum[name]), name


def test_a_checkpoint_without_the_kept_gradient_predicts_as_predict(tmp_path):
    spawn(_train_worker, 2, args=(cfg_of("predict", 2, 1, "--save", f"{tmp_path}/b",
                                         "--exit-interval", "3"), f"{tmp_path}/x"),
          timeout_minutes=1)
    plain = loaded(cfg_of("predict", 2, 1), f"{tmp_path}/b", f"{tmp_path}/p")
    nesterov = loaded(cfg_of("predict-nesterov", 2, 1), f"{tmp_path}/b", f"{tmp_path}/n")
    for a, b in zip(plain, nesterov):
        assert torch.equal(a["slot"], b["slot"]), "the first prediction is predict's, bitwise"
        assert torch.equal(b["optimizer"]["last_grad"], b["optimizer"]["exp_avg"])
    sharded = loaded(cfg_of("predict-nesterov", 1, 2, "--use-distributed-optimizer"),
                     f"{tmp_path}/b", f"{tmp_path}/s")
    grads, momentum = by_name(sharded, "last_grad"), by_name(sharded, "exp_avg")
    assert grads.keys() == momentum.keys() and all(torch.equal(grads[n], momentum[n])
                                                   for n in grads)
