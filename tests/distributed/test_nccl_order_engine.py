"""The NCCL-order validator replays what the engine really posts (issue 29 point 6): every rank of
a gloo run records each operation it posts and each wait, with its communicator, through its
Comm (p2p, the data-parallel reduce-scatter or all-reduce, the tied and norm all-reduces, the
distributed optimizer's all-gathers, the compensation's), and the sequence is exactly
`schedule.nccl_posts.stage_program`'s for that rank, with the data-parallel buckets started in
the batch's last backward and without; the run stays exact."""
import json
import os

import pytest

from megatron_2bw.parallel.grid import ProcessGrid
from megatron_2bw.pipeline.engine import PipelineEngine
from megatron_2bw.schedule.nccl_posts import INIT, POST, CommLayout, comm_name, stage_program
from megatron_2bw.schedule.tables import make_schedule
from megatron_2bw.testing.verify import parse, run

_LOG_DIR = "NCCL_ORDER_TEST_LOG_DIR"  # set by the test for its spawned ranks


class _Work:
    def __init__(self, work, log, entry):
        self.work, self.log, self.entry = work, log, entry

    def wait(self):
        self.log.append(["wait", *self.entry])
        return self.work.wait()

    def is_completed(self):
        return self.work.is_completed()


class _RecordingComm:
    """The grid's Comm, recording (post|wait, communicator, n) for every operation (n numbers
    this rank's posts on that communicator)."""

    def __init__(self, comm, grid, log):
        self._comm, self._grid, self._log, self._count = comm, grid, log, {}
        self._names = {id(grid.group(k)): comm_name(k, grid.group_ranks(k))
                       for k in ("tp", "dp", "mp", "tied") if grid.group(k) is not None}

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def _entry(self, name):
        n = self._count.get(name, 0)
        self._count[name] = n + 1
        self._log.append(["post", name, n])
        return [name, n]

    def _coll(self, call, group, *args, **kwargs):
        name = "world" if group is None else self._names[id(group)]
        entry = self._entry(name)
        work = getattr(self._comm, call)(*args, group=group, **kwargs)
        if not kwargs.get("async_op"):
            self._log.append(["wait", *entry])
            return work
        return _Work(work, self._log, entry)

    def all_reduce(self, tensor, group=None, **kwargs):
        return self._coll("all_reduce", group, tensor, **kwargs)

    def reduce_scatter(self, output, tensor, group=None, **kwargs):
        return self._coll("reduce_scatter", group, output, tensor, **kwargs)

    def all_gather_into(self, output, tensor, group=None, **kwargs):
        return self._coll("all_gather_into", group, output, tensor, **kwargs)

    def _pair(self, peer, gradients):
        lo, hi = sorted((self._grid.rank, peer))
        return f"pair-{'grad' if gradients else 'act'}[{lo},{hi}]"

    def send(self, tensor, peer, group=None):
        entry = self._entry(self._pair(peer, peer == self._grid.prev_rank))
        self._comm.send(tensor, peer, group)
        self._log.append(["wait", *entry])

    def recv(self, tensor, peer, group=None):
        entry = self._entry(self._pair(peer, peer == self._grid.next_rank))
        self._comm.recv(tensor, peer, group)
        self._log.append(["wait", *entry])

    def batch_isend_irecv(self, sends, recvs, group=None):
        peer = (sends or recvs)[0][1]
        gradients = peer == (self._grid.prev_rank if sends else self._grid.next_rank)
        entry = self._entry(self._pair(peer, gradients))
        works = self._comm.batch_isend_irecv(sends, recvs, group)
        return [_Work(w, self._log, entry) for w in works[:1]] + list(works[1:])


class RecordingEngine(PipelineEngine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.log = []
        comm = _RecordingComm(self.grid.comm, self.grid, self.log)
        self.stepper.comm = self.stepper.reduction.comm = self.p2p.comm = comm

    def fp32_state(self):
        state = super().fp32_state()  # the end of the run: a view (show_newest, every gather)
        with open(os.path.join(os.environ[_LOG_DIR], f"rank{self.grid.rank}.json"), "w") as f:
            json.dump(self.log, f)
        return state


def _collapse(log):
    """Runs of posts (or of waits) of collectives on one communicator as one, renumbered: the
    engine posts one reduce-scatter / all-gather per region of the weights, the validator one
    for all (posted back to back and waited back to back, they behave as one)."""
    out, counts, number = [], {}, {}
    for kind, comm, n in log:
        if not comm.startswith("pair") and out and out[-1][:2] == [kind, comm]:
            number[(comm, n)] = out[-1][2]
            continue
        if kind == "post":
            number[(comm, n)] = counts.get(comm, 0)
            counts[comm] = number[(comm, n)] + 1
        out.append([kind, comm, number[(comm, n)]])
    return out


def _model(cfg, grid_coords, layout):
    tp, s, dp = grid_coords
    sched = make_schedule(cfg.schedule, cfg.parallel.pipeline, cfg.num_microbatches,
                          cfg.train.train_iters)
    rank = stage_program(sched, layout, tp, s, dp)
    rank.view(cfg.train.train_iters)
    counts, out, seen = {}, [], {}
    for kind, op, _ in rank.prog:
        if op.what == INIT:
            continue  # the validator's rendezvous at a pair communicator's first use
        if kind == POST:
            seen[id(op)] = counts.get(op.comm, 0)
            counts[op.comm] = seen[id(op)] + 1
        out.append([kind, op.comm, seen[id(op)]])
    return rank.rank, out


@pytest.mark.parametrize("schedule,extra", [
    ("2bw", ["--use-distributed-optimizer", "--2bw-compensation", "predict"]),
    ("flush", ["--ddp-bucket-size", "3000"]),
    pytest.param("flush", ["--no-overlap-grad-reduce"], marks=pytest.mark.slow)])
def test_the_engine_posts_and_waits_as_the_validator_replays(schedule, extra, tmp_path,
                                                             monkeypatch):
    d, w = 2, 2
    cfg, _ = parse(["--schedule", schedule, "--pipeline-model-parallel-size", str(d),
                    "--data-parallel-size", str(w), "--global-batch-size", str(2 * d * w),
                    "--num-layers", str(d), "--hidden-size", "32", "--num-attention-heads", "4",
                    "--seq-length", "16", "--micro-batch-size", "2", "--lr", "3e-3",
                    "--train-iters", "3", "--timeout-minutes", "1", *extra])
    monkeypatch.setenv(_LOG_DIR, str(tmp_path))
    rep = run(cfg, timeout_minutes=2, engine_class=RecordingEngine)
    assert rep.passed(1e-5) and not rep.problems, rep
    layout = CommLayout(data=w, distributed_optimizer="--use-distributed-optimizer" in extra,
                        compensation="--2bw-compensation" in extra,
                        early_reduce="--no-overlap-grad-reduce" not in extra,
                        shapes="fixed")  # build_engine's: every batch [b, seq], no headers
    grid = ProcessGrid(1, d, w)
    for r in range(d * w):
        rank, want = _model(cfg, grid.coords(r), layout)
        assert rank == r
        got, want = _collapse(json.loads((tmp_path / f"rank{r}.json").read_text())), \
            _collapse(want)
        first = next((i for i, (x, y) in enumerate(zip(got + [None], want + [None]))
                      if x != y), None)
        assert first is None, f"rank {r}: first difference at {first}: engine " \
            f"{got[max(first - 3, 0):first + 3]} vs validator {want[max(first - 3, 0):first + 3]}"
