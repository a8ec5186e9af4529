"""Prove that a parallel layout reproduces single-process training (tools/verify_equivalence.py).

Spawns t * d * w local gloo processes, trains the GPT with the chosen schedule, and compares every
parameter of every rank with the single-process reference of docs/ARCHITECTURE.md section 1
(plain training for gpipe/flush, the delayed-update reference for 2bw, and for 2bw with
`--2bw-compensation M` that method's reference in megatron_2bw/testing/reference.py). The relative
difference of a tensor is ||a - b|| / max(||b||, init_std * sqrt(numel)) (L2 norms): a wrong update
anywhere moves many elements by about lr and shows up at 1e-3 and above, while single elements whose
gradient is only rounding noise (a dead GeLU unit, say; Adam normalizes their update to about lr
whatever its sign) cannot fail the check on their own. The run passes when the largest relative
difference over all tensors, and over the per-iteration losses, is within --rtol. It also checks
that the tied embedding copies on the first and last stage and all data-parallel replicas are
bitwise equal. `tests/distributed/test_equivalence.py` shows that a broken engine fails it
(`run(..., engine_class=...)`). Megatron's batch-size ramps (--rampup-batch-size,
--step-batch-size-schedule, --decrease-batch-size-if-needed) are judged the same way: the engine
changes m between batches, the reference runs each batch's m
(tests/distributed/test_ramp_equivalence.py).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from dataclasses import dataclass, field

import torch

from megatron_2bw.config import Config
from megatron_2bw.config.build import build_config
from megatron_2bw.config.flags import (FlagParser, add_model_args, add_parallel_args,
                                       add_training_args, exit_on_config_error)
from megatron_2bw.models.families import model_parts
from megatron_2bw.parallel.grid import ProcessGrid
from megatron_2bw.pipeline.engine import PipelineEngine
from megatron_2bw.tensor_parallel.shards import merge_tensor_shards
from megatron_2bw.testing.reference import build_sequential, reference_train
from megatron_2bw.training.build import build_engine, mock_batches
from megatron_2bw.training.spawn import spawn

DEFAULT_RTOL = {"fp32": 1e-5, "bf16": 3e-2, "fp16": 1e-2}


@dataclass
class Report:
    max_rel_diff: float = 0.0
    worst: str = ""
    max_loss_diff: float = 0.0
    tied_equal: bool = True
    replicas_equal: bool = True
    clipped_steps: int = 0
    problems: list[str] = field(default_factory=list)

    def passed(self, rtol: float) -> bool:
        return (not self.problems and self.max_rel_diff <= rtol and self.max_loss_diff <= rtol
                and self.tied_equal and self.replicas_equal)


EVAL_DATA_OFFSET = 10 ** 6  # evaluation samples come from far beyond the training ones


def _worker(rank: int, world_size: int, cfg: Config, outdir: str, engine_class,
            eval_interval: int = 0) -> None:
    grid = ProcessGrid.from_config(cfg, rank, world_size).init_groups()
    engine = build_engine(cfg, grid, "cpu", engine_class)
    data = mock_batches(cfg, grid.data, grid.dp_rank)
    eval_data = mock_batches(cfg, grid.data, grid.dp_rank, start_batch=EVAL_DATA_OFFSET,
                             training=False)
    engine.start(cfg.train.train_iters)
    losses, norms, eval_losses = [], [], []
    for it in range(cfg.train.train_iters):
        losses.append(engine.train_batch(data).clone())
        norms.append(engine.last_grad_norm.clone())
        if eval_interval and (it + 1) % eval_interval == 0:
            eval_losses.append(float(engine.eval_batch(eval_data)))
    torch.save({"params": {k: v.clone() for k, v in engine.fp32_state().items()},
                "tied": engine.weights.modules[0].tied_parameter_names(),
                "partition_dims": dict(zip(engine.weights.names, engine.weights.partition_dims)),
                "stage": grid.stage, "dp": grid.dp_rank, "tp": grid.tp_rank,
                "losses": torch.stack(losses).tolist(), "grad_norms": torch.stack(norms).tolist(),
                "eval_losses": eval_losses},
               os.path.join(outdir, f"rank{rank}.pt"))


def _rel(a: torch.Tensor, b: torch.Tensor, init_std: float) -> float:
    if not b.numel():
        return 0.0
    floor = init_std * b.numel() ** 0.5
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(floor))


def compare(cfg: Config, results: list[dict], ref_params: dict, ref_losses: list[float],
            ref_tied: dict[str, str], ref_eval: list[float] = ()) -> Report:
    rep = Report()
    losses_by_rank = [r["losses"] + r["eval_losses"] for r in results]
    ref_losses = list(ref_losses) + list(ref_eval)
    results = merge_tensor_shards(results, rep.problems)
    covered = set()
    by_dp_name: dict[tuple[int, str], torch.Tensor] = {}
    tied_copies: dict[tuple[int, str], list[torch.Tensor]] = {}
    for res in results:
        tied_name_to_key = {n: k for k, n in res["tied"].items()}
        for name, value in res["params"].items():
            key = tied_name_to_key.get(name)
            ref_name = ref_tied[key] if key is not None else name
            if ref_name not in ref_params:
                rep.problems.append(f"rank parameter {name} has no reference counterpart")
                continue
            covered.add(ref_name)
            r = _rel(value, ref_params[ref_name], cfg.model.init_method_std)
            if r > rep.max_rel_diff:
                rep.max_rel_diff, rep.worst = r, f"{name} (stage {res['stage']}, dp {res['dp']})"
            if key is not None:
                tied_copies.setdefault((res["dp"], key), []).append(value)
            other = by_dp_name.get((res["stage"], name))
            if other is not None and not torch.equal(other, value):
                rep.replicas_equal = False
            by_dp_name.setdefault((res["stage"], name), value)
    for losses in losses_by_rank:
        if len(losses) != len(ref_losses):
            rep.problems.append(f"{len(losses)} losses (training + evaluation) on a rank, "
                                f"{len(ref_losses)} in the reference")
        for a, b in zip(losses, ref_losses):
            rep.max_loss_diff = max(rep.max_loss_diff, abs(a - b) / max(abs(b), 1e-30))
    clip = cfg.optimizer.clip_grad
    rep.clipped_steps = sum(n > clip for n in results[0]["grad_norms"]) if clip > 0 else 0
    missing = set(ref_params) - covered
    if missing:
        rep.problems.append(f"reference parameters not found on any rank: {sorted(missing)}")
    for copies in tied_copies.values():
        if any(not torch.equal(copies[0], c) for c in copies[1:]):
            rep.tied_equal = False
    return rep


def run(cfg: Config, timeout_minutes: float = 2.0, eval_interval: int = 0,
        engine_class=PipelineEngine) -> Report:
    """Train the layout on spawned processes and compare with the reference (and, every
    `eval_interval` iterations, evaluation losses taken between training batches).
    `engine_class` (picklable) runs each stage: tests pass a deliberately broken engine to show
    that the comparison catches it."""
    world = cfg.parallel.tensor * cfg.parallel.pipeline * cfg.data_parallel_size
    with tempfile.TemporaryDirectory() as outdir:
        spawn(_worker, world, args=(cfg, outdir, engine_class, eval_interval),
              timeout_minutes=timeout_minutes)
        results = [torch.load(os.path.join(outdir, f"rank{r}.pt")) for r in range(world)]
    specs, loss_fn, _ = model_parts(cfg)
    w = cfg.data_parallel_size
    ref_params, ref_losses, ref_eval = reference_train(
        cfg, specs, loss_fn, lambda r: mock_batches(cfg, w, r), cfg.train.train_iters,
        eval_interval, lambda r: mock_batches(cfg, w, r, start_batch=EVAL_DATA_OFFSET,
                                              training=False))
    ref_tied = build_sequential(cfg, specs).tied_parameter_names()
    return compare(cfg, results, ref_params, ref_losses, ref_tied, ref_eval)


def parse(argv=None) -> tuple[Config, argparse.Namespace]:
    p = FlagParser(prog="verify_equivalence.py", description=__doc__.split("\n\n")[0],
                   allow_abbrev=False)
    add_model_args(p)
    add_parallel_args(p)
    add_training_args(p)
    # the judge's own settings, not Megatron's training defaults: the reference it compares
    # against has no dropout, a constant lr, no evaluation unless asked and one log per step
    p.set_defaults(hidden_dropout=0.0, attention_dropout=0.0, lr_decay_style="constant",
                   eval_interval=0, eval_iters=1, log_interval=1, initial_loss_scale=2.0 ** 16)
    p.add_argument("--schedule", dest="schedule_alias", default=None,
                   help="alias of --pipeline-schedule")
    p.add_argument("--model-type", choices=("gpt", "bert"), default="gpt")
    p.add_argument("--bert-no-binary-head", action="store_true")
    p.add_argument("--rtol", type=float, default=None,
                   help="tolerance on the relative difference (default: 1e-5 for fp32)")
    p.add_argument("--timeout-minutes", type=float, default=2.0,
                   help="per-collective timeout of the spawned ranks")
    args = p.parse_args(argv)
    if args.rtol is not None and args.rtol < 0:
        p.error(f"--rtol must be >= 0 (a relative tolerance), got {args.rtol}")
    if not args.timeout_minutes > 0:
        p.error(f"--timeout-minutes must be > 0, got {args.timeout_minutes}")
    if args.schedule_alias:
        args.pipeline_schedule = args.schedule_alias
    world = (args.tensor_model_parallel_size * args.pipeline_model_parallel_size
             * (args.data_parallel_size or 1))  # one replica unless --data-parallel-size says
    return build_config(args, args.model_type, world).config, args


def report(cfg: Config, rep: Report, rtol: float) -> int:
    """Print the verdict of a run; 0 if it passed, 1 if not."""
    p = cfg.parallel
    ok = rep.passed(rtol)
    print(f"verify_equivalence: model={cfg.model.family} schedule={cfg.schedule} "
          f"compensation={cfg.compensation} t={p.tensor} d={p.pipeline} w={p.data} "
          f"m={'->'.join(str(s.m) for s in cfg.batch_plan.reached(cfg.train.train_iters))} "
          f"iters={cfg.train.train_iters} "
          f"optimizer={cfg.optimizer.name} precision={cfg.precision.dtype}")
    if cfg.optimizer.clip_grad > 0:
        print(f"  gradient clipping at {cfg.optimizer.clip_grad}: active in "
              f"{rep.clipped_steps}/{cfg.train.train_iters} iterations")
    print(f"  max relative parameter difference {rep.max_rel_diff:.3e} (rtol {rtol:.1e})"
          + (f" at {rep.worst}" if rep.worst else ""))
    print(f"  max relative loss difference      {rep.max_loss_diff:.3e}")
    print(f"  tied embedding copies bitwise equal: {'yes' if rep.tied_equal else 'NO'}; "
          f"data-parallel replicas bitwise equal: {'yes' if rep.replicas_equal else 'NO'}")
    for problem in rep.problems:
        print(f"  problem: {problem}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def main(argv=None) -> int:
    cfg, args = exit_on_config_error(lambda: parse(argv))
    rtol = args.rtol if args.rtol is not None else DEFAULT_RTOL[cfg.precision.dtype]
    rep = run(cfg, timeout_minutes=args.timeout_minutes, eval_interval=args.eval_interval)
    return report(cfg, rep, rtol)


if __name__ == "__main__":
    sys.exit(main())
