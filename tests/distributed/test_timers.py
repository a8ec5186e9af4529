"""Action timers without host syncs: --wall-clock-breakdown and --trace record CUDA events on a
GPU and read them once per log interval (the host clock on the CPU); traces keep their format
(seconds since the epoch, readable by tools/plot_schedule.py --trace)."""
import os
import sys
import tempfile

import pytest
import torch

from megatron_2bw.config.build import build_config
from megatron_2bw.parallel.grid import ProcessGrid
from megatron_2bw.pipeline.timers import ActionClock
from megatron_2bw.pretrain import build_parser
from megatron_2bw.schedule import actions as A
from megatron_2bw.training.build import batches, mock_dataset
from megatron_2bw.training.loop import train
from megatron_2bw.training.spawn import spawn
from log_lines import interval_fields

sys.path.insert(0, os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))


def test_host_clock_totals_and_trace():
    clock = ActionClock("cpu")
    t = clock.start()
    clock.stop(t, "forward", [A.Action(A.FORWARD, mb=0, version=0)])
    assert clock.events() is None and set(clock) == {"forward"} and clock["forward"] >= 0
    clock.trace()
    t = clock.start()
    clock.stop(t, "p2p", [A.Action(A.SEND_ACT, mb=0), A.Action(A.RECV_GRAD, mb=1)])
    (label, start, end), = clock.events()
    assert label == "sa0 rg1" and start <= end and abs(start - __import__("time").time()) < 60
    clock.clear()
    assert dict(clock) == {} and len(clock.events()) == 1  # the trace outlives an interval


class FakeEvents:
    """torch.cuda.Event's interface on a fake device timeline: record() stamps the device time,
    which advances 1 ms per record; synchronize() is what a host sync would be."""

    def __init__(self):
        self.now, self.syncs, self.created = 0.0, 0, 0
        self.done_until = float("inf")  # the device has finished the events recorded up to here

    def __call__(self):
        self.created += 1
        outer = self

        class Event:
            stamp = None

            def record(self):
                outer.now += 1.0
                self.stamp = outer.now

            def synchronize(self):  # waits for this event, hence for every earlier one
                outer.syncs += 1
                outer.done_until = max(outer.done_until, self.stamp)

            def query(self):
                return self.stamp is not None and self.stamp <= outer.done_until

            def elapsed_time(self, other):
                return other.stamp - self.stamp
        return Event()


def test_event_clock_waits_once_per_read_not_per_action():
    events = FakeEvents()
    clock = ActionClock("cpu", make_event=events)
    clock.trace()
    for step in range(3):
        for mb in range(4):
            t = clock.start()
            clock.stop(t, "forward", [A.Action(A.FORWARD, mb=mb, version=0)])
        assert events.syncs == 1  # the anchor only: recording never waits for the device
        totals = dict(clock)
        assert events.syncs == 2
        events.syncs = 1
        assert totals == {"forward": pytest.approx(4 * 1e-3)}  # 1 ms between start and stop
        clock.clear()
    trace = clock.events()
    assert [e[0] for e in trace[:4]] == ["F0v0", "F1v0", "F2v0", "F3v0"]
    starts = [e[1] for e in trace]
    assert starts == sorted(starts) and trace[1][1] - trace[0][1] == pytest.approx(2e-3, abs=1e-6)
    assert events.created <= 1 + 2 * 4  # resolved events are reused


def test_a_trace_only_run_keeps_a_bounded_number_of_events(monkeypatch):
    from megatron_2bw.pipeline import timers
    monkeypatch.setattr(timers, "PENDING_LIMIT", 8)
    events = FakeEvents()
    clock = ActionClock("cpu", make_event=events)
    clock.trace()
    for mb in range(100):
        events.done_until = events.now - 6  # the device runs a few actions behind the host
        t = clock.start()
        clock.stop(t, "forward", [A.Action(A.FORWARD, mb=mb, version=0)])
        assert len(clock._pending) <= 8
    assert events.syncs == 1 and events.created <= 1 + 2 * 8  # never waited; events reused
    assert [e[0] for e in clock.events()] == [f"F{mb}v0" for mb in range(100)]


def test_the_cuda_clock_is_constructible_without_a_gpu():
    clock = ActionClock(torch.device("cuda", 0))  # touches nothing until the first action
    assert dict(clock) == {} and clock.events() is None and not clock.tracing


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_events_time_real_work():
    clock = ActionClock("cuda")
    clock.trace()
    x = torch.randn(2048, 2048, device="cuda")
    for _ in range(3):
        t = clock.start()
        x = x @ x / 2048
        clock.stop(t, "forward", [A.Action(A.FORWARD, mb=0, version=0)])
    assert clock["forward"] > 0 and len(clock.events()) == 3
    assert all(s < e for _, s, e in clock.events())


BASE = ("--mock-data --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
        "--micro-batch-size 2 --global-batch-size 8 --pipeline-model-parallel-size 2 "
        "--train-iters 4 --log-interval 2 --wall-clock-breakdown").split()


def _worker(rank, world_size, cfg, out):
    grid = ProcessGrid.from_config(cfg, rank, world_size).init_groups()
    dataset = mock_dataset(cfg)
    lines = []
    train(cfg, grid, "cpu", make_data=lambda s: batches(cfg, dataset, grid.data, grid.dp_rank, s),
          log=lines.append)
    torch.save(lines, f"{out}/log{rank}")


def test_engine_breakdown_and_trace_end_to_end():
    from plot_schedule import traced
    with tempfile.TemporaryDirectory() as d:
        argv = BASE + ["--trace", f"{d}/tr"]
        cfg = build_config(build_parser("gpt").parse_args(argv), "gpt", 2).config
        spawn(_worker, 2, args=(cfg, d), timeout_minutes=1)
        lines = [x for x in torch.load(f"{d}/log1") if interval_fields(x)]
        assert len(lines) == 2  # (beside them: the kernels line and the run summary)
        for key in ("ms forward", "ms backward", "ms p2p", "ms optimizer"):
            assert key in lines[0], lines[0]
        rows, unit, title = traced(f"{d}/tr")
        assert [name for name, _ in rows] == ["stage 0", "stage 1"] and unit == "ms"
        steps = [a for _, events in rows for _, _, acts in events for a in acts
                 if a.kind == A.STEP]
        assert len(steps) == 2 * 4
