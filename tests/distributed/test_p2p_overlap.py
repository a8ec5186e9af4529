"""Overlapped point-to-point (parallel/p2p.py, pipeline/interpreter.py): receives posted a group
early into pooled buffers, sends completed lazily, nothing in flight at a window boundary; results
stay exact and nothing deadlocks at d = 4 and 8 (issue 16)."""
import pytest
import torch

from megatron_2bw.parallel.comm import Comm
from megatron_2bw.parallel.grid import ProcessGrid
from megatron_2bw.parallel.p2p import P2P
from megatron_2bw.pipeline.engine import PipelineEngine
from megatron_2bw.pipeline.interpreter import comm_groups
from megatron_2bw.schedule import actions as A
from megatron_2bw.testing.verify import parse, run


class _CountingP2P(P2P):
    def __init__(self, *args):
        super().__init__(*args)
        self.allocated = 0

    def _acquire(self, signature):
        free = list(self._free.get(signature, ()))
        bufs = super()._acquire(signature)
        self.allocated += not any(bufs is f for f in free)
        return bufs


class OverlapCheckingEngine(PipelineEngine):
    """Asserts on every rank what the overlap promises: nothing in flight when a window ends,
    receives posted before their own group (on every stage that receives), and no receive
    buffer allocated once the pipeline is full (from the third training window on)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.p2p = _CountingP2P(self.grid, self.device)
        self.early, self.training_windows = 0, 0

    def _post_recv(self, a, early):
        posted = super()._post_recv(a, early)
        self.early += posted and early
        return posted

    def train_batch(self, data_iter):
        before = self.p2p.allocated
        loss = super().train_batch(data_iter)
        self.training_windows += 1
        assert self.p2p.idle, f"stage {self.stage}: a window ended with messages in flight"
        if self.training_windows >= 3:
            assert self.p2p.allocated == before, \
                f"stage {self.stage} allocated receive buffers in window {self.iteration - 1}"
            assert self.early > 0 or self.num_stages == 1, \
                f"stage {self.stage} never posted a receive early"
        return loss

    def eval_batch(self, *args, **kwargs):
        loss = super().eval_batch(*args, **kwargs)
        assert self.p2p.idle, f"stage {self.stage}: evaluation left messages in flight"
        return loss


def _flags(schedule, d, m):
    return ["--schedule", schedule, "--pipeline-model-parallel-size", str(d),
            "--global-batch-size", str(2 * m), "--num-layers", str(d), "--hidden-size", "32",
            "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
            "--lr", "3e-3", "--train-iters", "4", "--timeout-minutes", "1"]


@pytest.mark.parametrize("schedule,d", [("2bw", 4), ("flush", 4), ("gpipe", 4), ("2bw", 8),
                                        pytest.param("flush", 8, marks=pytest.mark.slow),
                                        pytest.param("gpipe", 8, marks=pytest.mark.slow)])
def test_overlapped_pipeline_is_exact_and_never_deadlocks(schedule, d):
    cfg, _ = parse(_flags(schedule, d, m=d))
    rep = run(cfg, timeout_minutes=2, eval_interval=2, engine_class=OverlapCheckingEngine)
    assert rep.passed(1e-5) and not rep.problems, rep


# ---- without processes --------------------------------------------------------------------------


def test_comm_groups_are_the_maximal_runs_of_communication():
    acts = [A.parse(x) for x in "ra0 F0v0 sa0 ra1 F1v0 sa1 rg0 B0v0 sg0 R0 N0 S0".split()]
    assert comm_groups(acts) == [(0, 1), (2, 4), (5, 7), (8, 9)]


class _Work:
    def __init__(self, log, what):
        self.log, self.what = log, what

    def wait(self):
        self.log.append(("wait", self.what))


class _FakeComm(Comm):
    """Records posts; every operation 'completes' when waited."""

    def __init__(self, backend="gloo"):
        super().__init__("cpu", backend)
        self.log, self.created = [], []

    def new_group(self, ranks, desc=None):
        self.created.append(list(ranks))
        return f"group{len(self.created) - 1}"

    def batch_isend_irecv(self, sends, recvs, group=None):
        ops = [("send", t, p) for t, p in sends] + [("recv", t, p) for t, p in recvs]
        self.log += [(kind, p, group) for kind, _, p in ops]
        return [_Work(self.log, (kind, p)) for kind, _, p in ops]


def _p2p(rank=1, backend="gloo"):
    comm = _FakeComm(backend)
    grid = ProcessGrid(1, 3, 1, rank=rank).init_groups(comm)
    return P2P(grid, "cpu"), comm, grid


def test_receive_buffers_come_back_from_the_pool():
    p2p, _, _ = _p2p()
    p2p.recv_meta = [(torch.Size([2, 3]), torch.float32, True)]
    first = p2p.activation_buffers()
    p2p.release(first)
    again = p2p.activation_buffers()
    assert again is first and not again[0].requires_grad and again[0].grad is None
    assert p2p.activation_buffers() is not first, "a buffer in use is never handed out twice"


def test_a_buffer_read_by_a_send_in_flight_is_not_reused():
    """A stage whose output aliases its input sends the buffer it received: that buffer stays
    out of the pool until the send completed."""
    p2p, comm, grid = _p2p()
    p2p.recv_meta = [(torch.Size([4]), torch.float32, False)]
    buf = p2p.activation_buffers()
    p2p.send([(buf[0][1:], grid.next_rank)])          # a view of it, in flight
    p2p.release(buf)
    assert p2p.activation_buffers() is not buf
    p2p.wait_sends()
    assert p2p.activation_buffers() is buf


def test_sends_complete_lazily_and_drain_empties_everything():
    p2p, comm, grid = _p2p()
    t = torch.zeros(2)
    p2p.send([(t, grid.next_rank)])
    p2p.send([(t, grid.prev_rank)])
    p2p.post_recv(("ra", 5), (torch.zeros(2),), grid.prev_rank)
    p2p.wait_sends(keep=1)
    assert [e for e in comm.log if e[0] == "wait"] == [("wait", ("send", grid.next_rank))]
    assert not p2p.idle
    p2p.drain()
    assert p2p.idle and ("wait", ("recv", grid.prev_rank)) in comm.log


@pytest.mark.parametrize("backend,split", [("gloo", False), ("nccl", True)])
def test_nccl_pairs_have_a_group_per_direction(backend, split):
    """Under NCCL a receive posted early must not queue ahead of a send to the same neighbour
    on one communicator: activations and gradients use two groups of the pair."""
    p2p, comm, grid = _p2p(backend=backend)
    assert len(comm.created) == len([g for gs in grid.all_group_ranks().values() for g in gs
                                     if len(g) > 1]) + 2 * split
    for peer in (grid.prev_rank, grid.next_rank):
        assert (grid.pair_group(peer, gradients=True) != grid.pair_group(peer)) == split
    t = torch.zeros(1)
    p2p.send([(t, grid.next_rank)])                    # activation out
    p2p.post_recv(("rg", 0), (t,), grid.next_rank)     # gradient in
    p2p.send([(t, grid.prev_rank)])                    # gradient out
    p2p.post_recv(("ra", 1), (t,), grid.prev_rank)     # activation in
    groups = [g for kind, _, g in comm.log if kind in ("send", "recv")]
    acts = {grid.pair_group(grid.next_rank), grid.pair_group(grid.prev_rank)}
    assert {groups[0], groups[3]} <= acts
    assert (groups[1] in acts, groups[2] in acts) == (not split, not split)
