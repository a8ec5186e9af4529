"""The action interpreter of one stage: runs a window of actions, overlapping its point-to-point
communication with compute. `PipelineEngine` (engine.py) is an `Interpreter` with the handlers
of F/B/R/N/S; the communication layer underneath is `parallel/p2p.py`.

A communication group of the table (consecutive ra/sa/rg/sg) is run as:

    1. its sends are posted (after the run's shape handshake; a header microbatch's first tensor
       with its tail, parallel/p2p.py "Shapes") and left to complete;
    2. its receives not yet posted are posted, in table order, into pooled buffers;
    3. the receives of the NEXT group of the window are posted too (early), in table order, as
       far as their shapes are known (activations: after the handshake; gradients: after the
       microbatch's forward; none after a header receive not checked yet): they arrive while
       this stage computes. Only where the NCCL-order
       validator proved it safe for this schedule and layout (`schedule/nccl_order.py`,
       `early_receives_safe`, asked once per schedule shape by `_plan_receives`); otherwise each
       receive is posted at its own group;
    4. the sends of earlier groups are waited for (they are normally done by then).

A receive is waited for right before the forward (ra) or backward (rg) that consumes it; the
wait is timed as "p2p" and traced under the receive's label. While it is in flight the stage
does pending work in pieces (`_idle_work`: the engine's deferred 2BW prediction on a CPU,
pipeline/compensation.py) and polls for it between pieces. At the end of every window
everything still in flight is waited for, so windows stay self-contained: evaluation, a
checkpoint or a new segment may run between any two windows. parallel/p2p.py says why this
order cannot deadlock a table the validator accepted.
"""
from __future__ import annotations

from megatron_2bw.config import Config
from megatron_2bw.models.stage import LayerSpec
from megatron_2bw.parallel.grid import ProcessGrid
from megatron_2bw.schedule import actions as A
from megatron_2bw.schedule.compensation_methods import compensation_method
from megatron_2bw.schedule.nccl_order import early_receives_safe
from megatron_2bw.schedule.comm_layout import CommLayout
from megatron_2bw.schedule.nccl_posts import comm_groups

_TIMER_NAMES = {A.FORWARD: "forward", A.BACKWARD: "backward", A.REDUCE: "all-reduce",
                A.NORM: "all-reduce", A.STEP: "optimizer"}


def comm_layout(cfg: Config, grid: ProcessGrid, specs: list[LayerSpec],
                shapes: str = "batch") -> CommLayout:
    """What the NCCL-order validator replays for this run, the same on every rank: one tensor
    rank and at most 2 replicas (the tensor ranks of a stage, and its replicas, run the same
    program, so their collectives complete together: more of them can neither make nor break a
    cycle), NCCL's pair layout (one group per direction; gloo matches each direction apart,
    which that covers), and a view between any two windows (evaluation, checkpoints)."""
    return CommLayout(
        tensor=1, data=min(grid.data, 2), rank_order=grid.rank_order,
        tied=grid.pipeline > 1 and any(sp.tied_key is not None for sp in specs),
        distributed_optimizer=cfg.parallel.distributed_optimizer,
        sequence_parallel=cfg.parallel.sequence_parallel and grid.tensor > 1,
        compensation=compensation_method(cfg.compensation).predicts, views=True,
        shapes=shapes, early_reduce=cfg.parallel.overlap_grad_reduce and grid.data > 1)


class Interpreter:
    """Needs `p2p` (parallel/p2p.P2P), `grid`, `first`, `last`, `_clock` and `_timed`; the
    stash dicts are its own (`_clear_stash`)."""

    _idle_work = None  # a callable doing one piece of pending work; False when none is left
    _early_receives = True  # post the next group's receives early (`_plan_receives`)
    _comm_layout = None     # schedule.nccl_order.CommLayout of this run (the engine's)
    shapes = "batch"        # schedule.actions.SHAPE_MODES: which microbatches carry a header
    _headers = (1, 0)       # (period, first microbatch of the run): `_is_header`

    def _plan_receives(self, schedule) -> None:
        """Before running `schedule`: post receives early only if the NCCL-order validator
        proved it safe on this layout (cached per schedule shape and layout: a dict lookup);
        which microbatches carry a shape header (`shapes`: schedule.actions.header_period)."""
        if self._comm_layout is not None:
            self._early_receives = early_receives_safe(schedule, self._comm_layout)
        m = schedule.num_microbatches
        self._headers = (A.header_period(self.shapes, m), schedule.first_batch * m)

    def _is_header(self, mb: int) -> bool:
        return A.is_header(*self._headers, mb)

    def _clear_stash(self) -> None:
        self.inputs: dict[int, tuple] = {}      # received activations (pooled buffers)
        self.outputs: dict[int, object] = {}    # stage outputs (graph) or the loss
        self.act_out: dict[int, tuple] = {}     # activations waiting to be sent
        self.grad_in: dict[int, tuple] = {}     # gradients received for our outputs (pooled)
        self.grad_out: dict[int, tuple] = {}    # gradients of our inputs waiting to be sent

    def _run(self, actions: list, handlers: dict) -> None:
        clock = self._clock if self._timed or self._clock.tracing else None
        groups, early = comm_groups(actions), self._early_receives
        g, i, n = 0, 0, len(actions)
        while i < n:
            a = actions[i]
            if a.is_comm:
                lo, hi = groups[g]
                g += 1
                ahead = actions[groups[g][0]:groups[g][1]] if early and g < len(groups) else ()
                token = clock.start() if clock is not None else None
                self._communicate(actions[lo:hi], ahead)
                if clock is not None:
                    clock.stop(token, "p2p", actions[lo:hi] if clock.tracing else None)
                i = hi
                continue
            if a.is_compute and self.p2p.pending:
                self._await_input(a, clock)
            token = clock.start() if clock is not None else None
            handlers[a.kind](a)
            if clock is not None:
                clock.stop(token, _TIMER_NAMES[a.kind], [a] if clock.tracing else None)
            i += 1
        if not self.p2p.idle:  # the window ends with nothing in flight
            token = clock.start() if clock is not None else None
            if self.p2p.unverified is not None:
                self._verify()
            self.p2p.drain()
            if clock is not None and groups:
                lo, hi = groups[-1]
                clock.stop(token, "p2p", actions[lo:hi] if clock.tracing else None)

    def _await_input(self, a, clock) -> None:
        """Wait for the receive `a` consumes (its activation or its output's gradient)."""
        kind = A.RECV_ACT if a.kind == A.FORWARD else A.RECV_GRAD
        key = (kind, a.mb)
        if key not in self.p2p.pending:
            return
        token = clock.start() if clock is not None else None
        idle = self._idle_work
        if idle is not None:
            while not self.p2p.arrived(key) and idle():
                pass
        if key == self.p2p.unverified:
            self._verify()
        else:
            self.p2p.wait_recv(key)
        if clock is not None:
            clock.stop(token, "p2p", [A.Action(kind, mb=a.mb)] if clock.tracing else None)

    def _communicate(self, group: list, ahead) -> None:
        sends = []
        for a in group:
            if a.kind == A.SEND_ACT:
                tensors = self.p2p.activation_sends(self.act_out.pop(a.mb), self.outputs[a.mb],
                                                    self._is_header(a.mb), a.mb)
                sends += [(t, self.grid.next_rank) for t in tensors]
            elif a.kind == A.SEND_GRAD:
                sends += [(t.contiguous(), self.grid.prev_rank) for t in self.grad_out.pop(a.mb)]
        self.p2p.send(sends)  # first: a buffer that a send reads is not handed out below
        for a in group:
            if a.kind in (A.RECV_ACT, A.RECV_GRAD):
                self._post_recv(a, early=False)
        for a in ahead:
            if a.kind in (A.RECV_ACT, A.RECV_GRAD) and not self._post_recv(a, early=True):
                break  # later ones wait too: receives are posted in table order
        self.p2p.wait_sends(keep=1)

    def _post_recv(self, a, early: bool) -> bool:
        """Post receive `a` unless it is posted already; early: only if its shapes are known.
        Returns whether it is posted."""
        if a.kind == A.RECV_ACT:
            if a.mb in self.inputs:
                return True
            p2p, peer = self.p2p, self.grid.prev_rank
            if p2p.recv_meta is None:
                if early:
                    return False
                p2p.ensure_meta_received()
            if p2p.unverified is not None:  # its shapes decide this one's
                if early:
                    return False
                self._verify()
            if self._is_header(a.mb):
                self.inputs[a.mb] = p2p.post_header_recv((a.kind, a.mb), peer)
                return True
            bufs = p2p.activation_buffers()
            self.inputs[a.mb] = bufs
        else:
            if a.mb in self.grad_in:
                return True
            if early and a.mb not in self.outputs:
                return False
            like = tuple(t for t in self.outputs[a.mb] if t.requires_grad)
            bufs, peer = self.p2p.gradient_buffers(like), self.grid.next_rank
            self.grad_in[a.mb] = bufs
        self.p2p.post_recv((a.kind, a.mb), bufs, peer)
        return True

    def _verify(self) -> None:
        """Wait for the header receive not checked yet and take the shapes it carries."""
        key = self.p2p.unverified
        self.inputs[key[1]] = self.p2p.verify(key, self.inputs[key[1]])

    def _received_inputs(self, mb: int) -> tuple:
        """The activation of microbatch `mb`, its leaves requiring grad as the handshake said."""
        return tuple(t.requires_grad_(req)
                     for t, (_, _, req) in zip(self.inputs[mb], self.p2p.recv_meta))
