"""Watching a long run (issue 21): TensorBoard events next to the wandb history of the same run,
the log line's pace, ETA and validation perplexity, the progress bar on a terminal only,
--profile traces holding the engine's action ranges, memory peaks per log interval.

Straggler and non-finite-gradient reports: test_numerics_straggler.py."""
import fcntl
import json
import math
import mmap
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from megatron_2bw.config.build import build_config
from megatron_2bw.parallel.grid import ProcessGrid
from megatron_2bw.pretrain import build_parser
from megatron_2bw.schedule import actions as A
from megatron_2bw.training.build import batches, build_engine, mock_batches, mock_dataset
from megatron_2bw.training.loop import train
from megatron_2bw.training.observe.logger import parse_line
from megatron_2bw.training.observe.memory import memory_peaks, reset_memory_peaks
from megatron_2bw.training.observe.progress import Pace, format_duration
from megatron_2bw.training.spawn import free_port, spawn
from test_resume import make_cfg, run

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
         "4", "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4"]


def _lines(prefix, rank=1):
    return open(f"{prefix}.{rank}").read().splitlines()


def _train_with_eval(rank, world_size, cfg, log):
    grid = ProcessGrid.from_config(cfg, rank, world_size).init_groups()
    dataset = mock_dataset(cfg)
    lines = []
    train(cfg, grid, "cpu", log=lines.append,
          make_data=lambda start: batches(cfg, dataset, grid.data, grid.dp_rank, start),
          make_eval_data=lambda: batches(cfg, dataset, grid.data, grid.dp_rank, 1000))
    open(f"{log}.{rank}", "w").write("".join(line + "\n" for line in lines))


def test_tensorboard_events_hold_the_scalars_of_the_wandb_history(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from megatron_2bw.testing.wandb_offline import read_history
    monkeypatch.setenv("WANDB_MODE", "offline")
    tb, wb, d = tmp_path / "tb", tmp_path / "wb", str(tmp_path)
    cfg = make_cfg(["--train-iters", "6", "--log-interval", "2", "--eval-interval", "3",
                    "--tensorboard-dir", str(tb), "--wandb-project", "t", "--wandb-save-dir",
                    str(wb), "--wall-clock-breakdown", "--log-timers-to-tensorboard"])
    spawn(_train_with_eval, 2, args=(cfg, f"{d}/log"), timeout_minutes=1)

    acc = EventAccumulator(str(tb), size_guidance={"scalars": 0})
    acc.Reload()
    board = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    runs = list(wb.glob("wandb/offline-run-*"))
    assert len(runs) == 1
    history = defaultdict(list)
    for row in read_history(str(runs[0])):
        for key, value in row.items():
            if not key.startswith("_"):
                history[key].append((row["_step"], value))
    for key in ("skipped-iterations", "nan-iterations", "samples/s", "tokens/s",
                "memory_GB_per_stage/stage0", "memory_GB_per_stage/stage1", "ms_forward",
                "ms_p2p", "grad-norm", "loss-scale", "iteration-time", "throughput"):
        assert [s for s, _ in board[key]] == [2, 4, 6], key
    # Megatron's tags: per iteration, per evaluation, and each again against the samples
    B = cfg.batch.global_batch_size
    for key in ("lm loss", "learning-rate", "batch-size"):
        assert [s for s, _ in board[key]] == [1, 2, 3, 4, 5, 6], key
        assert [s for s, _ in board[f"{key} vs samples"]] == [B * i for i in range(1, 7)], key
    assert [s for s, _ in board["lm loss validation"]] == \
        [s for s, _ in board["lm loss validation ppl"]] == [3, 6]
    assert [s for s, _ in board["lm loss validation vs samples"]] == [3 * B, 6 * B]
    assert not {"loss", "lr", "grad_norm", "validation_loss", "ms/iteration", "skipped",
                "consumed_samples", "learning_rate"} & set(board), "old and line names gone"
    # wandb: the same tags at the same iterations (no "vs samples" copies: Megatron's wandb
    # `samples vs steps`), every point at its own iteration although the evaluations (3, 6)
    # fall inside log intervals (2, 4, 6)
    assert sorted(history) == sorted([k for k in board if not k.endswith(" vs samples")]
                                     + ["samples vs steps"])
    for key, rows in history.items():
        if key == "samples vs steps":
            assert all(v == B * s for s, v in rows)
            continue
        assert [s for s, _ in board[key]] == [s for s, _ in rows], key
        assert [v for _, v in board[key]] == pytest.approx([v for _, v in rows], rel=1e-6), key

    logged = [parse_line(x) for x in _lines(f"{d}/log")]
    train = [(it, f) for it, f in filter(None, logged) if "lm loss" in f]
    assert [it for it, _ in train] == [2, 4, 6]
    per_iteration = dict(board["lm loss"])
    for it, fields in train:  # the line's lm loss: the mean over the interval's iterations
        assert fields["lm loss"] == pytest.approx(
            (per_iteration[it - 1] + per_iteration[it]) / 2, rel=1e-3)
        assert re.fullmatch(r"\d+[smhd]\d*[smh]?", fields["ETA"])
        assert fields["elapsed time per iteration (ms)"] > 0
    assert per_iteration[1] != pytest.approx(per_iteration[2], rel=1e-3), "a mean, not the last"
    assert train[-1][1]["ETA"] == "0s"
    valid = [(it, f) for it, f in filter(None, logged) if "lm loss value" in f]
    assert [it for it, _ in valid] == [3, 6]
    for it, f in valid:
        assert f["lm loss PPL"] == pytest.approx(math.exp(f["lm loss value"]), rel=1e-5)
        assert f["lm loss value"] == pytest.approx(dict(board["lm loss validation"])[it],
                                                   rel=1e-6)


def test_pace_reports_ms_per_iteration_and_an_eta_past_the_warm_up():
    now = [0.0]
    pace = Pace(100, clock=lambda: now[0])
    now[0] = 10.0                      # the first interval (10 iterations) holds a slow warm-up
    assert pace.interval(10, 10) == (10.0, pytest.approx(90 * 1.0))
    now[0] = 12.0                      # then 0.2 s per iteration
    assert pace.interval(20, 10) == (2.0, pytest.approx(80 * 0.2))
    now[0] = 16.0                      # 0.4 s: the mean since the warm-up is 0.3 s
    assert pace.interval(30, 10) == (4.0, pytest.approx(70 * 0.3))
    assert [format_duration(s) for s in (0.4, 59, 61, 3600 * 5 + 61, 86400 * 2 + 7200)] == \
        ["0s", "59s", "1m01s", "5h01m", "2d02h"]


def _pretrain(stdout, stderr, timeout=120):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(WANDB_MODE="offline", PYTHONPATH=str(ROOT), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), TERM="xterm")
    return subprocess.Popen([sys.executable, str(ROOT / "pretrain_gpt.py"), *SMALL,
                             "--train-iters", "6", "--log-interval", "3"],
                            cwd=ROOT, env=env, stdout=stdout, stderr=stderr)


def test_progress_bar_on_a_terminal_plain_lines_otherwise():
    plain = _pretrain(subprocess.PIPE, subprocess.PIPE)
    out, err = plain.communicate(timeout=120)
    assert plain.returncode == 0, err
    assert "training:" not in out.decode() and "it/s" not in out.decode()
    assert [parse_line(x)[0] for x in out.decode().splitlines() if parse_line(x)] == [3, 6]

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 160, 0, 0))  # 160 columns
    proc = _pretrain(slave, subprocess.PIPE)
    os.close(slave)
    seen = b""
    while True:
        ready, _, _ = select.select([master], [], [], 120)
        assert ready, "the run stopped writing"
        try:
            chunk = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    assert proc.wait(timeout=60) == 0, proc.stderr.read()
    text = seen.decode(errors="replace")
    assert re.search(r"training: +100%\|.*\| 6/6", text), text[-2000:]
    lines = [parse_line(x.strip("\r")) for x in re.split(r"[\r\n]+", text)]
    assert [p[0] for p in lines if p] == [3, 6], "the log lines still appear"


def test_cpu_memory_peak_resets_each_interval():
    reset_memory_peaks("cpu")
    base, reserved = memory_peaks("cpu")
    assert reserved is None
    size = 256 * 2 ** 20
    block = mmap.mmap(-1, size)
    block.write(b"\1" * size)           # resident now
    block.close()                       # and given back to the kernel
    peak, _ = memory_peaks("cpu")
    assert peak - base > 0.2, (base, peak)
    reset_memory_peaks("cpu")
    assert memory_peaks("cpu")[0] < peak - 0.2, "the next interval starts from the current RSS"


def test_profile_ranges_cost_nothing_when_off_and_name_every_action_when_on():
    cfg = build_config(build_parser("gpt").parse_args(SMALL), "gpt", 1).config
    engine = build_engine(cfg, ProcessGrid(1, 1, 1), "cpu")
    data = mock_batches(cfg, 1, 0)
    engine.start(3)
    engine.train_batch(data)
    plain = engine._handlers
    engine.profile_actions(True)
    with torch.profiler.profile() as prof:
        engine.train_batch(data)
    engine.profile_actions(False)
    ranges = [e.name for e in prof.events() if re.fullmatch(r"[FB]\d+v\d|[RNS]1", e.name)]
    assert sorted({name[0] for name in ranges}) == ["B", "F", "N", "R", "S"]
    assert sum(name[0] == "F" for name in ranges) == cfg.num_microbatches
    assert engine._handlers is plain and "_communicate" not in vars(engine)


def test_profile_writes_a_trace_per_rank_with_the_engine_action_ranges(tmp_path):
    d = str(tmp_path)
    cfg = make_cfg(["--train-iters", "5", "--save", d, "--trace", f"{d}/trace", "--profile",
                    "--profile-step-start", "2", "--profile-step-end", "4",
                    "--profile-ranks", "0", "1"])
    run(cfg, f"{d}/l")
    for rank in (0, 1):
        path = tmp_path / "profile" / f"rank{rank}.iter3-4.pt.trace.json"
        events = json.loads(path.read_text())["traceEvents"]
        ranges = [e["name"] for e in events if e.get("cat") == "user_annotation"]
        assert sum(name.startswith("ProfilerStep#") for name in ranges) == 2
        actions = [name for name in ranges  # torch's own ranges: the steps, gloo, the loader
                   if not name.startswith(("ProfilerStep#", "gloo:", "enumerate(DataLoader)"))]
        kinds = {A.parse(token).kind for name in actions for token in name.split()}
        assert {A.FORWARD, A.BACKWARD, A.REDUCE, A.NORM, A.STEP} <= kinds
        assert kinds & set(A.COMM_KINDS), "p2p groups are ranges too"
        assert sum(A.parse(n).kind == A.FORWARD for n in actions if " " not in n) == 2 * 4
        engine_trace = json.load(open(f"{d}/trace.rank{rank}.json"))["events"]
        assert set(actions) <= {label for label, _, _ in engine_trace}, \
            "the ranges carry the engine's own --trace labels"
        assert any(e.get("cat") == "cpu_op" for e in events), "the operators inside them"
    assert not (tmp_path / "profile" / "rank0.iter1-2.pt.trace.json").exists()


def test_without_the_tensorboard_package_logging_works_and_tensorboard_dir_is_one_line(
        monkeypatch, tmp_path):
    from megatron_2bw.training.observe import writers as log_writers
    from megatron_2bw.config import ConfigError
    from megatron_2bw.training.observe.logger import TrainLogger
    tb = tmp_path / "tb"
    with_tb, without = (build_config(build_parser("gpt").parse_args(SMALL + extra), "gpt", 1)
                        .config for extra in (["--tensorboard-dir", str(tb)], []))
    log_writers.check_tensorboard(with_tb.train)
    assert tb.is_dir()
    monkeypatch.setitem(sys.modules, "tensorboard", None)   # as if it were not installed
    missing = r"^--tensorboard-dir needs the tensorboard package: pip install tensorboard"
    with pytest.raises(ConfigError, match=missing):
        log_writers.check_tensorboard(with_tb.train)       # pretrain, before any process group
    with pytest.raises(ConfigError, match=missing):
        TrainLogger(with_tb, ProcessGrid(1, 1, 1), reporter=True)  # a direct training.train
    lines = []
    logger = TrainLogger(without, ProcessGrid(1, 1, 1), True, lines.append)
    logger.log(1, {"loss": 2.5, "ETA": "3s"})
    logger.finish()
    assert parse_line(lines[0]) == (1, {"loss": 2.5, "ETA": "3s"})
