#!/usr/bin/env python
"""The prepared GPU check: run it once on a GPU node before the first cluster job.

    python tools/gpu_check.py                     # a GPU node; under 8 minutes on one H200
    python tools/gpu_check.py --quick             # under 2 minutes: fewer iterations, 1 verify
    python tools/gpu_check.py --out check.json    # the numbers as JSON too
    python tools/gpu_check.py --dry-run [--quick] # anywhere: print and validate the plan only

Steps, each a subprocess whose output is streamed and kept in WORK/<step>.log:

1. train    torchrun, one process, NCCL: megatron_2bw.cli.pretrain_gpt (pretrain_gpt.py) with
            GPT-125M (`--model gpt-125m`, seq 1024, vocab 50304), bf16, mock data, 2BW, evaluation
            every 50 iterations; it stops at --exit-interval 100 and saves a checkpoint (--save);
2. resume   the same job resumed with --load to iteration 150 (its log must continue at 110),
            with --wall-clock-breakdown, --trace and a torch.profiler trace (--profile) of two
            iterations: the timers use CUDA events, so its step time should match train's;
3. verify   with 2+ GPUs: megatron_2bw.testing.verify (tools/verify_equivalence.py)
            --distributed-backend nccl for every schedule (--quick: 2bw only) at d=2 (every
            parameter against the single-process reference).
--quick: train stops at 30, resume runs to 50, a 115 s limit.

The whole check stops after 470 s (a step gets at most the time left). It prints step time,
tokens/s, TFLOP/s per GPU (Megatron's model FLOPs), model-FLOPs utilization against the
device's peak (training/observe/devices.py, or --peak-tflops), peak memory (max_memory_allocated)
next to the planner's memory model of the same layout (planner/cost_model.py), the kernels the
job configured and the ones the profiler saw run, the validation losses and the verify verdicts;
exit 0 when every step passed and every requirement of tools/gpu_check_report.py held (MFU at or
above --mfu-floor, flash attention, fused AdamW, TF32).

--dry-run builds the same plan, validates every command's flags through the real parsers
(pretrain.parse and verify.parse: the checks a job makes before its process group), checks the
scripts, launcher and directories it would use, computes the planner's prediction and checks
the log parser against the training logger's own format. It starts no process. `--gpus N`
pretends N GPUs (with 2+ the plan includes the verify steps).
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field

# the directory megatron_2bw is imported from: the steps import the same copy (a checkout or
# an installed wheel)
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRETRAIN_GPT, VERIFY = "megatron_2bw.cli.pretrain_gpt", "megatron_2bw.testing.verify"

from megatron_2bw.config.numbers import FiniteParser
from megatron_2bw.fs import atomic_write_text
from megatron_2bw.schedule.kinds import schedule_names
from megatron_2bw.testing.gpu_check_report import (  # noqa: F401 (tests use them from here)
    Requirements, failed_requirements, parse_log, profiled_kernels, report, summarize)

GPT_125M = ("--model", "gpt-125m", "--seq-length", "1024", "--vocab-size", "50304")
VERIFY_MODEL = ("--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
                "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "16",
                "--train-iters", "6", "--pipeline-model-parallel-size", "2")


@dataclass
class Settings:
    gpus: int
    work_dir: str
    exit_iters: int = 100          # train stops (and saves) here
    train_iters: int = 150         # resume continues to here
    micro_batch: int = 8
    global_batch: int = 64
    log_interval: int = 10
    eval_interval: int = 50
    eval_iters: int = 4
    model: tuple = GPT_125M
    precision: tuple = ("--bf16",)
    backend: str = "nccl"
    timeouts: dict = field(default_factory=lambda: {"train": 270, "resume": 200, "verify": 120})
    time_limit_s: float = 470.0    # the whole check: a step gets at most what is left
    quick: bool = False
    verify_schedules: tuple | None = None  # None: every schedule
    require: Requirements = field(default_factory=Requirements)

    @classmethod
    def quick_mode(cls, **kw) -> "Settings":
        """The --quick check: the same steps, fewer iterations, one verify; under 2 minutes."""
        return cls(**{"exit_iters": 30, "train_iters": 50, "log_interval": 5,
                      "eval_interval": 25, "eval_iters": 2, "time_limit_s": 115.0,
                      "timeouts": {"train": 60, "resume": 50, "verify": 40}, "quick": True,
                      "verify_schedules": ("2bw",), **kw})


@dataclass
class Step:
    name: str
    module: str          # the Python module it runs (`python -m`, torchrun --module)
    args: list           # its flags
    nproc: int | None    # torchrun processes; None: plain python
    timeout_s: int

    @property
    def argv(self) -> list:
        launcher = [sys.executable]
        if self.nproc is not None:
            launcher += ["-m", "torch.distributed.run", "--standalone",
                         f"--nproc_per_node={self.nproc}"]
        return launcher + ["-m", self.module] + [str(a) for a in self.args]


def plan(s: Settings) -> list[Step]:
    ckpt, trace = os.path.join(s.work_dir, "checkpoints"), os.path.join(s.work_dir, "trace")
    job = [*s.model, "--mock-data", *s.precision, "--distributed-backend", s.backend,
           "--micro-batch-size", s.micro_batch, "--global-batch-size", s.global_batch,
           "--pipeline-schedule", "2bw", "--train-iters", s.train_iters,
           "--lr", "6e-4", "--min-lr", "6e-5", "--lr-decay-style", "cosine",
           "--lr-warmup-iters", "10", "--weight-decay", "0.1", "--clip-grad", "1.0",
           "--adam-beta2", "0.95", "--log-interval", s.log_interval, "--log-throughput",
           "--eval-interval", s.eval_interval, "--eval-iters", s.eval_iters, "--save", ckpt]
    steps = [Step("train", PRETRAIN_GPT, job + ["--exit-interval", s.exit_iters], 1,
                  s.timeouts["train"]),
             Step("resume", PRETRAIN_GPT,
                  job + ["--load", ckpt, "--wall-clock-breakdown", "--trace", trace,
                         "--profile", "--profile-step-start", s.exit_iters + s.log_interval,
                         "--profile-step-end", s.exit_iters + s.log_interval + 2], 1,
                  s.timeouts["resume"])]
    if s.gpus >= 2:  # every training schedule (a tiny model: seconds each)
        for schedule in s.verify_schedules or schedule_names():
            steps.append(Step(f"verify-{schedule}", VERIFY,
                              ["--distributed-backend", s.backend, "--schedule", schedule,
                               *VERIFY_MODEL], None, s.timeouts["verify"]))
    return steps


# ---- checking the plan without running it ---------------------------------------------------


def parse_step(step: Step):
    """The step's config through the real front door (pretrain.parse / verify.parse), as the
    launched process would build it; raises ValueError with the parser's one-line error."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            if step.module == PRETRAIN_GPT:
                from megatron_2bw.pretrain import parse
                return parse("gpt", [str(a) for a in step.args])[0]
            from megatron_2bw.testing.verify import parse
            return parse([str(a) for a in step.args])[0]
    except SystemExit as e:
        lines = [x for x in err.getvalue().splitlines() if x.strip()]
        raise ValueError(lines[-1] if lines else f"exit {e.code}") from None


def planner_memory_gib(cfg) -> dict:
    """The planner's memory model of the (one-stage) job, GiB per buffer and "total"."""
    from megatron_2bw.planner import GB, AnalyticProfile, Layout, Setup, Topology, stage_plan
    from megatron_2bw.planner.cost_model import LayerTimes
    setup = Setup(cfg.model, cfg.precision.dtype, cfg.optimizer.name, cfg.model.family)
    layout = Layout(cfg.schedule, 1, 1, 1, cfg.batch.micro_batch_size, cfg.num_microbatches,
                    cfg.model.full_recompute, selective=cfg.model.selective_recompute)
    topo = Topology(num_nodes=1, gpus_per_node=1)
    memory = stage_plan(setup, layout, LayerTimes(setup, AnalyticProfile(), topo), topo).memory[0]
    return {k: v / GB for k, v in memory.items()}


def check_log_parser() -> None:
    """The parser reads what the training logger writes (catches a format change)."""
    from megatron_2bw.config import Config
    from megatron_2bw.training.observe.logger import TrainLogger
    lines, fields = [], {"lm loss": 7.5, "throughput per GPU (TFLOP/s/GPU)": 55.5,
                         "samples/s": 100.0, "tokens/s": 102400.0,
                         "memory GB per stage": [9.5], "ms forward": 3.0}
    logger = TrainLogger(Config(), None, True, lines.append)
    logger.log(10, fields)
    logger.validation(10, 7.25, 1408.1, rows=[])
    got = parse_log("\n".join(lines))
    if got["iterations"] != [{"iteration": 10, **fields}] or got["validation"] != [(10, 7.25)]:
        raise ValueError(f"the log parser does not read the logger's lines: {lines}")


def validate(steps: list[Step], s: Settings) -> list[str]:
    """Every problem the plan would run into, one line each (empty: the plan is sound)."""
    problems = []
    for module in sorted({st.module for st in steps}):
        if importlib.util.find_spec(module) is None:
            problems.append(f"{module}: not importable: install megatron_2bw (pip install .)")
    if importlib.util.find_spec("torch.distributed.run") is None:
        problems.append("torch.distributed.run (torchrun) is not importable: install torch")
    try:
        os.makedirs(s.work_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=s.work_dir):
            pass
    except OSError as e:
        problems.append(f"{s.work_dir}: not writable ({e.strerror}): pass --work-dir DIR")
    for st in steps:
        try:
            cfg = parse_step(st)
        except ValueError as e:
            problems.append(f"step {st.name}: {e}")
            continue
        if st.name == "train":
            try:
                planner_memory_gib(cfg)
            except Exception as e:  # noqa: BLE001 - reported as a problem of the plan
                problems.append(f"planner memory model: {type(e).__name__}: {e}")
    try:
        check_log_parser()
    except ValueError as e:
        problems.append(str(e))
    return problems


# ---- running and reading the logs -----------------------------------------------------------


def run_step(step: Step, log_path: str, echo=print) -> tuple[int, str, float]:
    """Run the step in its own process group (killed whole on timeout); (rc, output, seconds)."""
    path = PACKAGE_PARENT + os.pathsep + os.environ.get("PYTHONPATH", "")
    env = dict(os.environ, PYTHONPATH=path,
               WANDB_MODE=os.environ.get("WANDB_MODE", "offline"))
    start, lines = time.time(), []
    proc = subprocess.Popen(step.argv, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    timer = threading.Timer(step.timeout_s, _kill_group, (proc,))
    timer.start()
    with open(log_path, "w") as log:
        for line in proc.stdout:
            log.write(line)
            lines.append(line)
            echo(f"  [{step.name}] {line.rstrip()}")
    rc = proc.wait()
    timer.cancel()
    if time.time() - start >= step.timeout_s:
        lines.append(f"gpu_check: {step.name} killed after its {step.timeout_s} s timeout\n")
        rc = rc or 124
    return rc, "".join(lines), time.time() - start


def _kill_group(proc) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
            return


def execute(s: Settings, peak: float | None, device: str, out_path: str | None = None,
            echo=print) -> dict:
    """Run the plan (stops at the first failed step), print the report, return the numbers."""
    steps = plan(s)
    model_gib = planner_memory_gib(parse_step(steps[0]))
    logs, rcs, deadline = {}, {}, time.time() + s.time_limit_s
    for st in steps:
        st.timeout_s = int(min(st.timeout_s, deadline - time.time()))
        if st.timeout_s < 30:
            logs[st.name], rcs[st.name] = "", 124
            echo(f"gpu_check: {st.name}: skipped, the {s.time_limit_s:g} s limit is spent")
            break
        echo(f"gpu_check: {st.name}: {' '.join(st.argv)}")
        rcs[st.name], logs[st.name], seconds = run_step(
            st, os.path.join(s.work_dir, f"{st.name}.log"), echo)
        echo(f"gpu_check: {st.name}: exit {rcs[st.name]} after {seconds:.0f} s")
        if rcs[st.name]:
            break
    out = summarize(s, logs, rcs, peak, model_gib,
                    os.path.join(s.work_dir, "checkpoints", "profile"))
    echo(report(out, device))
    if out_path:
        atomic_write_text(out_path, json.dumps({"device": device, "settings": asdict(s), **out},
                                               indent=1))
    return out


def dry_run(s: Settings, echo=print) -> int:
    """Print the plan and every problem it would run into; 0 when there is none."""
    steps = plan(s)
    for st in steps:
        echo(f"gpu_check: {st.name} ({st.timeout_s} s max): {' '.join(st.argv)}")
    problems = validate(steps, s)
    for line in problems:
        echo(f"problem: {line}")
    if not problems:
        mem = planner_memory_gib(parse_step(steps[0]))
        echo(f"planner memory model of the train step: {mem['total']:.2f} GiB per GPU")
    r = s.require
    echo("requirements: MFU " + ("not checked" if r.mfu_floor is None else
                                 f">= {r.mfu_floor:.0%}")
         + f", attention {' or '.join(r.attention) or 'any'}"
         + (", fused AdamW" if r.fused_adamw else "") + (", TF32 fp32 matmuls" if r.tf32 else ""))
    echo(f"dry run ({'quick' if s.quick else 'full'}): {len(steps)} steps for {s.gpus} GPU(s), "
         + ("all valid" if not problems else f"{len(problems)} problem(s)"))
    return 1 if problems else 0


def main(argv=None) -> int:
    p = FiniteParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="print and validate the plan only")
    p.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all visible; "
                                                          "with --dry-run: pretend this many)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's peak dense bf16 TFLOP/s (default: its table entry)")
    p.add_argument("--micro-batch-size", type=int, default=8, help="lower it on small GPUs")
    p.add_argument("--work-dir", default=None, help="checkpoints, traces and logs (default: a "
                                                     "temporary directory)")
    p.add_argument("--out", default=None, help="also write the numbers to this JSON file")
    p.add_argument("--quick", action="store_true", help="under 2 minutes: 30 + 20 iterations, "
                                                        "one verify schedule")
    p.add_argument("--mfu-floor", type=float, default=Requirements.mfu_floor,
                   help="the model-FLOPs utilization PASS needs (default %(default)s: GPT-125M "
                        "in bf16 on an H100/H200-class GPU; lower it for smaller GPUs)")
    a = p.parse_args(argv)
    for flag, bad in (("--gpus", a.gpus is not None and a.gpus < 1),
                      ("--micro-batch-size", a.micro_batch_size < 1),
                      ("--peak-tflops", a.peak_tflops is not None and a.peak_tflops <= 0),
                      ("--mfu-floor", not 0 <= a.mfu_floor <= 1)):
        if bad:  # one line, exit 2, before any step runs
            p.error(f"{flag} {getattr(a, flag[2:].replace('-', '_'))}: must be "
                    + ("in [0, 1] (a fraction of the peak)" if flag == "--mfu-floor" else
                       "> 0" if flag == "--peak-tflops" else ">= 1"))

    def settings(gpus, work):
        kw = {"gpus": gpus, "work_dir": work, "micro_batch": a.micro_batch_size,
              "require": Requirements(mfu_floor=a.mfu_floor)}
        return Settings.quick_mode(**kw) if a.quick else Settings(**kw)
    import torch
    from megatron_2bw.training.observe.devices import peak_tflops
    if a.dry_run:
        with contextlib.ExitStack() as stack:
            work = a.work_dir or stack.enter_context(tempfile.TemporaryDirectory())
            gpus = a.gpus if a.gpus is not None else max(torch.cuda.device_count(), 1)
            return dry_run(settings(gpus, work))
    if not torch.cuda.is_available():
        print("error: no CUDA device here: run on a GPU node (or --dry-run to check the plan)",
              file=sys.stderr)
        return 2
    work = a.work_dir or tempfile.mkdtemp(prefix="gpu_check-")
    device = torch.cuda.get_device_name(0)
    gpus = min(a.gpus or torch.cuda.device_count(), torch.cuda.device_count())
    s = settings(gpus, work)
    os.makedirs(work, exist_ok=True)
    out = execute(s, a.peak_tflops or peak_tflops(device), device, a.out)
    print(f"gpu_check: logs, checkpoints and traces in {work}")
    return 0 if out["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
