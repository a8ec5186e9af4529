"""The shared entry point of pretrain_gpt.py and pretrain_bert.py.

Order matters: watch the launcher (a worker never outlives it), parse flags, build the tokenizer
(the config needs its vocabulary), build and validate the typed config once
(`config.build.build_config`: flags, DeepSpeed JSON, planner), check the checkpoint
directories and what resuming changes (a new layout, e.g. from --auto-plan on a new allocation:
the log says what changed, and another model is refused; checkpoint/resume.py), then the data
(every bad input is a one-line error, exit 2), and only then start the process group and train:
`check_before_start` writes nothing into --save or --load, so a refused run leaves them as they
were. The process group starts in the order clusters need (distributed.start_process_group): the
rank's device from LOCAL_RANK or SLURM_LOCALID made current, `init_process_group(device_id=...)`,
then the grid's groups. How a run ends:

    0    trained to --train-iters, or stopped by --exit-* / SIGTERM / SIGUSR1 / SIGINT after
         saving a checkpoint (when --save is set)
    1    a rank failed: one line naming it (a traceback too when the error is unexpected)
    2    bad input, before any process group
    130  aborted by Ctrl-C without a checkpoint (no --save, or a second Ctrl-C)
"""
from __future__ import annotations

import os
import signal
import sys
from typing import Any, Callable, NamedTuple

from megatron_2bw.config import Config, ConfigError
from megatron_2bw.config.build import build_config
from megatron_2bw.config.compat import add_compat_args
from megatron_2bw.config.launcher_env import env_rank_world
from megatron_2bw.config.mds_flags import add_mds_args
from megatron_2bw.config.flags import (FlagParser, add_model_args, add_parallel_args,
                                       add_training_args, exit_on_config_error)
from megatron_2bw.config.paths import check_output_paths
from megatron_2bw.data.build import build_pretrain_data, pretrain_tokenizer
from megatron_2bw.data.flags import add_data_args
from megatron_2bw.parallel.comm import PeerError
from megatron_2bw.parallel.devices import backend_device, default_backend
from megatron_2bw.parallel.distributed import destroy_process_group, start_process_group
from megatron_2bw.parallel.launcher import (check_rendezvous, launched, local_rank_problem,
                                            node_ranks)
from megatron_2bw.pipeline.faults import NO_FAULTS, FaultHooks, NumericsError
from megatron_2bw.training.reliability import abort_on_sigint, hold_usr1, watch_launcher


def build_parser(family: str) -> FlagParser:
    p = FlagParser(prog=f"pretrain_{family}.py", allow_abbrev=False,
                   description=f"Pretrain a {family.upper()} with a pipeline engine "
                               "(2bw, flush or gpipe).")
    add_model_args(p)
    add_parallel_args(p)
    add_training_args(p)
    add_data_args(p, family)
    g = p.add_argument_group("DeepSpeed config")
    g.add_argument("--deepspeed_config", "--deepspeed-config", "--deepscale_config",
                   dest="deepspeed_config", default=None,
                   help="DeepSpeed JSON; a setting that conflicts with a flag you typed is an "
                        "error naming both (--deepscale_config: DeepSpeed's old name)")
    g.add_argument("--deepspeed", "--deepscale", dest="deepspeed", action="store_true",
                   help="Megatron-DeepSpeed's: its meaning of the flags where it differs from "
                        "Megatron-LM's (config/mds_flags.py)")
    g = p.add_argument_group("auto-plan")
    g.add_argument("--auto-plan", action="store_true",
                   help="choose t, d, w, micro batch, rank order, recomputation, the schedule "
                        "and the stage partition with the planner; whatever you fix by flag or "
                        "DeepSpeed JSON stays fixed (the global batch must be given)")
    g.add_argument("--plan-topology", default=None,
                   help="topology JSON (default: SLURM / visible devices)")
    g.add_argument("--plan-profile", default=None,
                   help="profile JSON from tools/plan.py --profile-out")
    g.add_argument("--device-tflops", type=float, default=None)
    g.add_argument("--device-efficiency", type=float, default=None)
    g.add_argument("--no-memory-check", action="store_true",
                   help="start even when the planner's memory model says a rank's buffers do "
                        "not fit in its device's free memory")
    add_mds_args(p)
    add_compat_args(p)  # last: Megatron's other flags, where no group above took them
    return p


class Parsed(NamedTuple):
    cfg: Config
    data: Any                    # data.build.PretrainData
    rank: int
    world_size: int
    local_rank: int
    lr_schedule: Callable | None = None  # a DeepSpeed JSON's scheduler (None: the Config's)
    beside: dict | None = None   # what every save records beside its iterations (the tokenizer)


def parse(family: str, argv=None) -> Parsed:
    """The flags, then `check_before_start`: this rank's checks (one line and exit 2 on the
    first problem)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(family).parse_args(argv)
    rank, world_size, local_rank = exit_on_config_error(env_rank_world)  # a bad launch: 1 line
    given = args.local_rank if args.local_rank is not None and args.local_rank >= 0 else None
    if given is not None and not launched():  # one process: its device, as in Megatron
        local_rank = given  # (-1, "not distributed" in older scripts, is no device)
    return exit_on_config_error(lambda: check_before_start(family, args, argv, rank, world_size,
                                                           local_rank, given))


def check_before_start(family: str, args, argv: list, rank: int, world_size: int,
                       local_rank: int, given: int | None) -> Parsed:
    """Every check this rank makes before any process group, in order: the launch, the config
    (tokenizer, flags, DeepSpeed JSON, planner), the checkpoint directories and the model and
    layout --load's checkpoint was saved for, the loggers and output paths, the data, the memory.
    It writes nothing into --save or --load: the leftovers of killed writers go once every rank
    has started (training/loop.py) and the tokenizer is recorded with the first save (`beside`),
    so a refused run leaves both as they were."""
    check_rendezvous(world_size)
    problem = local_rank_problem(argv, given, local_rank)
    if problem:
        raise ConfigError(problem)
    tokenizer, built = _config(family, args, argv, rank, world_size)
    cfg = built.config
    _checkpoint_checks(cfg, args, rank, world_size)
    from megatron_2bw.training.observe.writers import check_loggers
    check_loggers(cfg.train)  # tensorboard and wandb: found and importable
    check_output_paths(cfg.train)  # every path a run writes, before the first iteration
    data = _data(cfg, args, family, rank, world_size, local_rank, tokenizer)
    if not args.no_memory_check:  # every rank, before any process group
        from megatron_2bw.planner.memory_check import check_memory
        check_memory(cfg, world_size, rank, local_rank)
    from megatron_2bw.checkpoint.convert.tokenizers import tokenizer_files
    beside = tokenizer_files(data.tokenizer) if cfg.train.save else {}  # generate.py reads it
    return Parsed(cfg, data, rank, world_size, local_rank, built.lr_schedule, beside)


def _config(family: str, args, argv: list, rank: int, world_size: int):
    """(the tokenizer, config.build's result: the validated Config, its notes printed on rank 0,
    a DeepSpeed JSON's lr schedule)."""
    from megatron_2bw.config.ds_json import explicit_flags
    tokenizer, vocab_size = pretrain_tokenizer(args, family)
    planner = None
    if args.auto_plan:
        from megatron_2bw.planner import plan, planner_inputs
        topology, profile = planner_inputs(args, world_size)
        log = (lambda line: print(line, flush=True)) if rank == 0 else None
        planner = lambda cfg: plan(cfg, topology, profile, log)  # noqa: E731
    eod = tokenizer.eod if tokenizer is not None and (
        args.eod_mask_loss or args.reset_position_ids or args.reset_attention_mask) else None
    built = build_config(args, family, world_size, explicit_flags(argv), vocab_size, planner,
                         eod=eod, checkpoint=checkpoint_args(args))
    if rank == 0:
        for line in built.notes:
            print(line, flush=True)
    return tokenizer, built


def _checkpoint_checks(cfg: Config, args, rank: int, world_size: int) -> None:
    """--load and --save (checkpoint.api.preflight), and what resuming --load's checkpoint
    changes or cannot take: another model, layout or data position (checkpoint/resume.py)."""
    from megatron_2bw.checkpoint.api import preflight as check_directories
    from megatron_2bw.checkpoint.resume import resume_note
    start = check_directories(cfg.train, rank, log=lambda line: print(line, flush=True))
    if args.exit_on_missing_checkpoint and cfg.train.load and not start \
            and not cfg.train.finetune:
        raise ConfigError(f"--exit-on-missing-checkpoint: --load {cfg.train.load} holds no "
                          "checkpoint; drop the flag to start from scratch")
    note = resume_note(cfg, world_size, planned=args.auto_plan)  # or a one-line error
    if note and rank == 0:
        print(note, flush=True)


def _data(cfg: Config, args, family: str, rank: int, world_size: int, local_rank: int,
          tokenizer):
    """This rank's data (data.build.PretrainData; middle stages read none), every bad input a
    one-line error."""
    t, gbs = cfg.train, cfg.batch.global_batch_size
    valid = ((t.train_iters // t.eval_interval + 1) * t.eval_iters * gbs
             if t.eval_interval else 0)
    valid = max(valid, t.eval_iters * gbs) if t.skip_train else valid
    from megatron_2bw.training.build import data_role
    reads, builder = data_role(cfg, rank, world_size, node_ranks(rank, local_rank))
    data = build_pretrain_data(args, family, cfg.model.seq_length, t.seed,
                               cfg.batch_plan.consumed(t.train_iters), valid,
                               tokenizer=tokenizer, reads=reads, builder=builder)
    if t.skip_train and data.valid is None:
        raise ConfigError("--skip-train evaluates the validation data, and it is empty: "
                          "give --split a validation part (or --valid-data-path)")
    return data


def checkpoint_args(args):
    """(where, saved config) of --use-checkpoint-args's checkpoint, or None (flag off, or --load
    holds none yet: the flags as given, as Megatron does)."""
    if not args.use_checkpoint_args:
        return None
    if not args.load:
        raise ConfigError("--use-checkpoint-args reads the model's settings from --load DIR: "
                          "give --load")
    from megatron_2bw.checkpoint.resume import saved_config
    saved = saved_config(args.load)
    return None if saved is None else (f"{args.load} iteration {saved[0]}", saved[1])


def main(family: str, argv=None, hooks: FaultHooks = NO_FAULTS) -> int:
    """Train; `hooks` injects faults (tests only, see tests/fault_entry.py)."""
    hold_usr1()  # SLURM's pre-timeout signal during start-up: kept for training to act on
    if launched():
        watch_launcher()
    try:
        return _main(family, argv, hooks)
    except KeyboardInterrupt:
        _exit("error: interrupted (SIGINT) before training started", 130)


def _main(family: str, argv, hooks: FaultHooks) -> int:
    cfg, data, rank, world_size, local_rank, lr_schedule, beside = parse(family, argv)
    # nccl needs GPUs: one line, exit 2, before any process group (not in parse: a dry run that
    # only validates a GPU job's flags, tools/gpu_check.py --dry-run, runs without GPUs)
    exit_on_config_error(lambda: backend_device(cfg.parallel.backend or default_backend(),
                                                local_rank))
    comm = start_process_group(rank, world_size, local_rank, backend=cfg.parallel.backend,
                               timeout_minutes=cfg.parallel.timeout_minutes)
    from megatron_2bw.parallel.grid import ProcessGrid
    grid = ProcessGrid.from_config(cfg, rank, world_size).init_groups(comm)
    device, backend = comm.device, comm.backend
    from megatron_2bw.training.kernels import configure_math
    configure_math(cfg, device)
    if rank == 0:
        print(f"megatron-2bw: {family} schedule={cfg.schedule} t={grid.tensor} d={grid.pipeline} "
              f"w={grid.data} micro-batch={cfg.batch.micro_batch_size} "
              f"global-batch={_ramped(cfg, lambda s: s.batch)} "
              f"m={_ramped(cfg, lambda s: s.m)} "
              f"precision={cfg.precision.dtype} backend={backend}", flush=True)
        from megatron_2bw.models.flops import num_parameters
        print(f"megatron-2bw: {num_parameters(cfg.model) / 1e6:.2f}M parameters "
              f"({cfg.model.num_layers} layers, hidden {cfg.model.hidden_size}, "
              f"{cfg.model.num_attention_heads} heads, vocab {cfg.model.vocab_size}, "
              f"seq {cfg.model.seq_length})", flush=True)
    interrupted = (f"error: {grid.describe()} aborted by SIGINT: no checkpoint of this point "
                   "(one Ctrl-C saves one when --save is set)")
    # (training/reliability.py: a KeyboardInterrupt can be lost)
    previous = abort_on_sigint(interrupted)
    try:
        _train(cfg, grid, device, data, hooks, lr_schedule, beside)
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    except KeyboardInterrupt:
        _exit(interrupted, 130)
    except BaseException as e:  # noqa: BLE001 - name the failed rank, let the launcher stop the rest
        if isinstance(e, SystemExit) and not e.code:
            raise
        # expected errors say it in one line; a peer's timeout or death (PeerError) is that
        # peer's story, not this rank's: no traceback of the wait it interrupted
        if not isinstance(e, (ConfigError, NumericsError, PeerError)):
            import traceback
            traceback.print_exc()
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        _exit(f"error: {grid.describe()} failed: {type(e).__name__}: {first}", 1)
    grid.comm.barrier()
    destroy_process_group()
    return 0


def _ramped(cfg: Config, value) -> str:
    """`value(stretch)` of the run's batch stretches: "16->32->48" along a batch-size ramp,
    "16->...->1536" along a long one."""
    values = [str(value(s)) for s in cfg.batch_plan.reached(cfg.train.train_iters)]
    return "->".join(values if len(values) <= 4 else [values[0], "...", values[-1]])


def _exit(line: str, code: int) -> None:
    """Print one line on stderr and leave at once (no atexit, no waiting on peers)."""
    print(line, file=sys.stderr, flush=True)
    os._exit(code)


def _train(cfg, grid, device, data, hooks: FaultHooks, lr_schedule=None, beside=None) -> None:
    from megatron_2bw.training.build import batches
    from megatron_2bw.training.loop import train
    train(cfg, grid, device, lr_schedule=lr_schedule,
          make_data=lambda start: batches(cfg, data.train, grid.data, grid.dp_rank, start),
          make_eval_data=(lambda: batches(cfg, data.valid, grid.data, grid.dp_rank,
                                          training=False))
          if data.valid is not None else None,
          log=lambda line: print(line, flush=True), hooks=hooks,
          progress=sys.stdout if sys.stdout.isatty() else None,  # a bar on a terminal only
          beside=beside)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
