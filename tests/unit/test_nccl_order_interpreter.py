"""The NCCL-order validator's program is what the real interpreter posts (issue 29 point 6): an
Interpreter over recording Comm/P2P doubles posts and waits in the order schedule/nccl_posts.py
replays, with and without early receives and shape headers, and the engine asks one layout on
every rank (the validator itself: test_nccl_order.py)."""
import pytest
import torch
from test_nccl_order import _schedule

from megatron_2bw.parallel.comm import Comm
from megatron_2bw.parallel.grid import ProcessGrid
from megatron_2bw.parallel.p2p import P2P, encode_meta, with_header
from megatron_2bw.pipeline.interpreter import Interpreter
from megatron_2bw.schedule import (CommLayout, NcclOrderError, check_nccl_order,
                                   early_receives_safe)
from megatron_2bw.schedule import actions as A
from megatron_2bw.schedule.actions import shape_mode
from megatron_2bw.schedule.kinds import schedule_kind
from megatron_2bw.schedule.nccl_posts import stage_program
from megatron_2bw.schedule.simulate import check_schedule
from megatron_2bw.schedule.tables import Schedule


class _Work:
    def __init__(self, log, entry):
        self.log, self.entry = log, entry

    def wait(self):
        self.log.append(("wait", self.entry))


class _RecordingComm(Comm):
    """Records every p2p post as (comm name, [(direction, peer, tag)]) and every wait."""

    def __init__(self):
        super().__init__("cpu", "nccl")
        self.log, self.names, self.recv_key = [], {}, None

    def new_group(self, ranks, *args, **kwargs):
        return object()

    def batch_isend_irecv(self, sends, recvs, group=None):
        parts = [("send", p, int(t[0])) for t, p in sends] + \
            [("recv", p, self.recv_key) for _, p in recvs]
        entry = (self.names[id(group)], tuple(parts))
        self.log.append(("post", entry))
        return [_Work(self.log, entry) for _ in parts[:1]]

    def send(self, tensor, peer, group=None):
        entry = (self.names[id(group)], (("send", peer, "meta"),))
        self.log += [("post", entry), ("wait", entry)]

    def recv(self, tensor, peer, group=None):
        tensor.copy_(encode_meta((torch.zeros(2, requires_grad=True),), "cpu"))
        entry = (self.names[id(group)], (("recv", peer, "meta"),))
        self.log += [("post", entry), ("wait", entry)]


class _RecordingP2P(P2P):
    def post_recv(self, key, buffers, peer):
        self.comm.recv_key = key[1]
        super().post_recv(key, buffers, peer)
        if key == self.unverified:  # a header receive: the tail the sender writes, unchanged
            like = tuple(torch.zeros(s, dtype=d, requires_grad=r) for s, d, r in self.recv_meta)
            buffers[0].copy_(with_header(like[0].detach(), encode_meta(like, "cpu")))


class _Stage(Interpreter):
    """The real interpreter with handlers that only make tensors (microbatch k's are k)."""

    class _NoClock:
        tracing = False

    def __init__(self, d, s, layout=None):
        comm = _RecordingComm()
        self.grid = ProcessGrid(1, d, 1, rank=s).init_groups(comm)
        for peer, gradients, key in ((self.grid.prev_rank, False, "act-in"),
                                     (self.grid.prev_rank, True, "grad-out"),
                                     (self.grid.next_rank, False, "act-out"),
                                     (self.grid.next_rank, True, "grad-in")):
            if peer is not None:
                lo, hi = sorted((s, peer))
                comm.names[id(self.grid.pair_group(peer, gradients))] = \
                    f"pair-{'grad' if gradients else 'act'}[{lo},{hi}]"
        self.p2p, self.comm = _RecordingP2P(self.grid, "cpu"), comm
        self.first, self.last = s == 0, s == d - 1
        self._clock, self._timed, self._comm_layout = self._NoClock(), False, layout
        self._clear_stash()
        self.handlers = {A.FORWARD: self._f, A.BACKWARD: self._b, A.REDUCE: lambda a: None,
                         A.NORM: lambda a: None, A.STEP: lambda a: None}

    def _f(self, a):
        x = torch.full((2,), float(a.mb), requires_grad=True)
        self.outputs[a.mb] = (x,)
        self.act_out[a.mb] = (x.detach(),)
        if not self.first and not self.training:  # eval frees its input at the forward
            self.p2p.release(self.inputs.pop(a.mb))

    def _b(self, a):
        self.outputs.pop(a.mb)
        if not self.last:
            self.p2p.release(self.grad_in.pop(a.mb))
        if not self.first:
            self.p2p.release(self.inputs.pop(a.mb))
            self.grad_out[a.mb] = (torch.full((2,), float(a.mb)),)

    def run(self, sched, s):
        self._plan_receives(sched)
        self.training = sched.is_training
        for t in range(sched.first_batch, sched.first_batch + sched.num_batches):
            self._run(sched.window(s, t), self.handlers)
        return self.comm.log


def _model_log(sched, layout, s):
    out, names = [], {}
    for kind, op, _ in stage_program(sched, layout, 0, s, 0).prog:
        if not op.comm.startswith("pair") or op.parts is None:  # (INIT: no operation of torch)
            continue
        parts = tuple((dr, p, "meta" if tag[0] == "meta" else tag[1]) for dr, p, tag in op.parts)
        names.setdefault(id(op), (op.comm, parts))
        out.append((kind, names[id(op)]))
    return out


@pytest.mark.parametrize("kind,d,m,t0", [("2bw", 4, 4, 0), ("2bw", 3, 5, 1), ("2bw", 2, 2, 2),
                                         ("flush", 4, 2, 0), ("flush", 4, 6, 1),
                                         ("gpipe", 3, 3, 0), ("forward", 4, 3, 0)])
@pytest.mark.parametrize("early", [True, False])
def test_the_interpreter_posts_and_waits_as_the_validator_replays(kind, d, m, t0, early):
    """The real Interpreter over a recording P2P: every p2p post (communicator, direction, peer,
    microbatch) and every wait, in order, on every stage, is the validator's program, with
    receives posted early and without."""
    sched = _schedule(schedule_kind(kind), d, m, t0).materialized()
    for s in range(d):
        stage = _Stage(d, s)
        stage._early_receives = early
        got = stage.run(sched, s)
        want = _model_log(sched, CommLayout(early_receives=early), s)
        assert got == want, f"stage {s}: first difference at " \
            f"{next(i for i, (x, y) in enumerate(zip(got + [None], want + [None])) if x != y)}"


@pytest.mark.parametrize("kind,d,m,t0", [("2bw", 4, 4, 1), ("flush", 3, 3, 0),
                                         ("forward", 3, 4, 0)])
def test_with_a_shape_header_on_every_microbatch_the_model_is_still_the_interpreter(kind, d, m,
                                                                                    t0):
    """dynamic_shape: every microbatch after the run's first carries a header, so nothing is
    posted early on act-in behind one; the validator replays that too (and it posts fewer
    receives early than the per-batch headers do)."""
    sched = _schedule(schedule_kind(kind), d, m, t0).materialized()
    early_posts = {}
    for dynamic in (False, True):
        layout = CommLayout(shapes=shape_mode(dynamic))
        for s in range(d):
            stage = _Stage(d, s)
            stage.shapes = shape_mode(dynamic)
            got = stage.run(sched, s)
            assert got == _model_log(sched, layout, s), (dynamic, s)
            early_posts[dynamic] = early_posts.get(dynamic, 0) + sum(
                op.what.endswith("(posted early)")
                for k, op, _ in stage_program(sched, layout, 0, s, 0).prog if k == "post")
    assert early_posts[True] < early_posts[False]


def test_the_engine_asks_one_layout_on_every_rank():
    """`interpreter.comm_layout` (the engine's): the same CommLayout on every rank of a run (so every rank posts by
    one verdict), one tensor rank and at most two replicas (their programs are the same), the
    run's options."""
    from megatron_2bw.models.stage import LayerSpec
    from megatron_2bw.pipeline.interpreter import comm_layout
    from megatron_2bw.testing.verify import parse
    cfg, _ = parse(["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                    "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "8",
                    "--use-distributed-optimizer"])
    specs = [LayerSpec(build=None, tied_key="embed"), LayerSpec(build=None),
             LayerSpec(build=None, tied_key="embed")]
    layouts = {comm_layout(cfg, ProcessGrid(2, 2, 4, rank=r), specs) for r in range(16)}
    assert layouts == {CommLayout(tensor=1, data=2, tied=True, distributed_optimizer=True,
                                  views=True, early_reduce=True)}
    assert not comm_layout(cfg, ProcessGrid(2, 2, 4), specs[1:2]).tied
    late = cfg.replace(parallel={"overlap_grad_reduce": False})
    assert not comm_layout(late, ProcessGrid(2, 2, 4), specs).early_reduce


# one microbatch at a time (a custom table the simulator accepts): safe with each receive at its
# own group on a shared pair communicator, a cycle when stage 1 posts ra1 early before its sg0
ONE_AT_A_TIME = [[A.parse(x) for x in "F0v0 sa0 rg0 B0v0 F1v0 sa1 rg1 B1v0 R0 N0 S0".split()],
                 [A.parse(x) for x in "ra0 F0v0 B0v0 sg0 ra1 F1v0 B1v0 sg1 R0 N0 S0".split()]]


def test_where_early_receives_deadlock_the_engine_posts_them_at_their_own_group():
    sched = Schedule.from_table(ONE_AT_A_TIME)
    check_schedule(sched)
    shared = CommLayout(split_pairs=False)
    with pytest.raises(NcclOrderError) as e:
        check_nccl_order(sched, shared)
    assert str(e.value).splitlines()[1:] == [
        "  rank 0 (stage 0, tp 0, dp 0) blocks in 0B0v0 waiting for rg0 on pair[0,1]",
        "  rank 0 (stage 0, tp 0, dp 0)'s rg0 [0sa0 0rg0] on pair[0,1] needs rank 1 (stage 1, "
        "tp 0, dp 0)'s sg0, queued behind ra1 (posted early) [1ra0]",
        "  rank 1 (stage 1, tp 0, dp 0)'s ra1 (posted early) [1ra0] on pair[0,1] needs rank 0 "
        "(stage 0, tp 0, dp 0) to post sa1",
        "  -> back to rank 0 (stage 0, tp 0, dp 0)"]
    check_nccl_order(sched, CommLayout(split_pairs=False, early_receives=False))
    assert early_receives_safe(sched, shared) is False
    assert early_receives_safe(sched, CommLayout()) is True
    for s in range(2):  # the real interpreter asks, and then posts nothing early
        stage = _Stage(2, s, shared)
        got = stage.run(sched, s)
        assert stage._early_receives is False
        assert got == _model_log(sched, CommLayout(early_receives=False), s)
        assert _Stage(2, s, CommLayout()).run(sched, s) == _model_log(sched, CommLayout(), s)
    assert _model_log(sched, CommLayout(), 1) != _model_log(sched, CommLayout(
        early_receives=False), 1)
