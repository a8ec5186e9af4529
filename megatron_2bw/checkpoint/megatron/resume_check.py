"""The resume check of a Megatron checkpoint, before any process group (checkpoint/resume.py
calls it): its common state read without a tensor, and every way it cannot continue as this
run, in one line (the architecture, the lr schedule unless --override-opt_param-scheduler or
--finetune, the optimizer's settings when its state carries over)."""
from __future__ import annotations

from megatron_2bw.checkpoint.files import CheckpointError
from megatron_2bw.checkpoint.megatron.common import (args_of, consumed_samples, model_problems,
                                                     optimizer_problems, parallel_of,
                                                     schedule_problems)
from megatron_2bw.checkpoint.megatron.detect import OURS_KEY, stage_files


def foreign_state(directory: str, found) -> dict:
    """The checkpoint's common state: common.pt (torch_dist), or the first stage file without
    reading its tensors (torch format; zip's CRC-32 checked first), or a DeepSpeed save's
    (checkpoint/deepspeed_pipe/megatron_read.py)."""
    if found.format == "deepspeed":
        from megatron_2bw.checkpoint.deepspeed_pipe.megatron_read import deepspeed_common
        return deepspeed_common(directory)
    if found.format == "megatron":
        from megatron_2bw.checkpoint.megatron.dist_read import read_megatron_common
        return read_megatron_common(directory, verified=found.verified)
    from megatron_2bw.checkpoint.megatron.pickles import load_megatron_file
    from megatron_2bw.checkpoint.torch_format import record_problem
    path = stage_files(directory)[0]
    problem = record_problem(path)
    if problem:
        raise CheckpointError(problem)
    state = load_megatron_file(path, mmap=True)
    return {k: v for k, v in state.items() if k != "model"}


def saved(directory: str, found) -> tuple[str, dict, int, dict]:
    """(format words, the layout it was saved with, consumed samples, its common state)."""
    state = foreign_state(directory, found)
    it = int(state.get("iteration", 0))
    ours = state.get(OURS_KEY)
    if ours:  # our own export: our record says what saved it
        return (f"megatron-core torch_dist by {found.writer}", dict(ours.get("parallel") or {}),
                int(ours.get("consumed_samples", 0)), state)
    if found.format == "deepspeed":
        return (f"DeepSpeed pipeline checkpoint by {found.writer}", state["parallel"],
                state["consumed_samples"], state)
    fmt = "megatron-core torch_dist" if found.format == "megatron" else \
        f"Megatron torch format ({found.writer})"
    args = args_of(state)
    # without Megatron's args the data position is unknown: the iterations' samples go on
    consumed = consumed_samples(state, it) if "consumed_train_samples" in args else None
    return fmt, parallel_of(args), consumed, state


def resume_problems(cfg, state: dict, where: str) -> None:
    """One CheckpointError naming every way the checkpoint cannot continue as this run."""
    if state.get(OURS_KEY):
        return  # our own record: checkpoint/layout.py checks it (resume.py, and when read)
    args, t = args_of(state), cfg.train
    version = state.get("checkpoint_version")
    problems = []
    if version is not None and float(version) < 2.0:
        problems.append(f"checkpoint_version {version} (Megatron's QKV order before 2.0; "
                        "convert it with Megatron's own tools first)")
    problems += model_problems(args, cfg.model)
    if not t.finetune and not t.override_opt_param_scheduler:
        problems += [f"{p}, or --override-opt_param-scheduler to keep this run's"
                     for p in schedule_problems(state, cfg, cfg.global_batch_size)]
    if t.load_optim and not t.finetune:
        problems += optimizer_problems(state, cfg)
    if problems:
        raise CheckpointError(f"--load {where} (a Megatron checkpoint, iteration "
                              f"{state.get('iteration')}) differs from this run: "
                              f"{'; '.join(problems)}")

