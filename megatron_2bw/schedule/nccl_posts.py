"""What every rank posts and waits for, in order, when the engine runs a schedule: the input of
the NCCL-order validator (nccl_order.py). PURE: no torch, no process groups.

A rank's program is a list of ("post", op, label) and ("wait", op, label), label naming the
action(s) the engine runs when it posts or waits. It mirrors, step for step:

    pipeline/interpreter.py  `_run` (a communication group; the wait for a receive right before
                             the forward/backward that consumes it; `drain` at the window's end),
                             `_communicate` (sends first, one batch per peer in rank order, the
                             run's shape handshake as a blocking send/recv; the group's
                             receives; the next group's receives early, in table order, while
                             their shapes are known; then the wait for all but the newest send)
                             and `_post_recv` (one batch per receive; none on act-in after a
                             header receive before its wait: p2p.py "Shapes", unchanged);
    parallel/p2p.py          activations on the pair's activation group (s -> s+1), gradients on
                             its gradient group (s+1 -> s): one group each under NCCL
                             (`split_pairs`), one shared group under gloo's layout;
    pipeline/grad_reduce.py  with `early_reduce`, the data-parallel buckets the stage's last
                             backward of batch t produces start inside it (before that
                             backward's tensor-parallel all-reduces: a bound on when they post);
    pipeline/batch_step.py   R: the sequence-parallel all-reduce over tp (blocking), then the
                             data-parallel all-reduce of the other buckets (distributed
                             optimizer: reduce-scatter) and
                             the tied all-reduce (first and last stage) started async; N: waits
                             for dp (and tied on the first stage), starts the norm all-reduce
                             over mp (distributed optimizer: the world); S: waits for tied and
                             norm (fp16's inf check is a host sync on that result), and with the
                             distributed optimizer waits for the slot's last all-gather and starts
                             the next (compensation.py `publish`); F waits for the all-gather of
                             its slot (`wait_weights`);
    pipeline/compensation.py a view between windows (evaluation, a checkpoint) under a
                             predicting compensation: `show_newest` (all-gather, waited) then
                             `resume` at the next window (all-gather); every view waits for all
                             gathers (`wait_weights()`);
    tensor parallel          each F and B all-reduces over its tp group (stream-ordered);
    NCCL                     the first use of a pair communicator may create it (a blocking
                             rendezvous of its two ranks): `lazy_p2p_init`.

`tests/unit/test_nccl_order.py` runs the real Interpreter over a recording P2P and checks that
it posts and waits exactly as `stage_program` says.
"""
from __future__ import annotations

from megatron_2bw.schedule.actions import (BACKWARD, FORWARD, NORM, RECV_ACT, RECV_GRAD, REDUCE,
                                           SEND_ACT, SEND_GRAD, STEP, header_period, is_header)
from megatron_2bw.schedule.comm_layout import CommLayout, rank_of

POST, WAIT = "post", "wait"
INIT = "communicator init"  # what the first use of a pair communicator is (lazy_p2p_init)


def comm_groups(actions: list) -> list[tuple[int, int]]:
    """[(lo, hi)] of the maximal runs of communication actions, in order (what the interpreter
    posts together)."""
    groups, i, n = [], 0, len(actions)
    while i < n:
        if actions[i].is_comm:
            j = i
            while j < n and actions[j].is_comm:
                j += 1
            groups.append((i, j))
            i = j
        else:
            i += 1
    return groups


class Op:
    """One posted operation of one rank: a collective, or a batch of point-to-point parts
    [(direction 'send'|'recv', peer rank, (action kind, microbatch))] on one communicator.
    `what` says what it is ("sa3", "rg2 (posted early)", "grad-norm all-reduce N1"), `label`
    names the action(s) that posted it ("1sa3 1rg2")."""
    __slots__ = ("rank", "comm", "parts", "_what", "_label", "stage", "seq", "done", "links")

    def __init__(self, rank, stage, comm, parts, what, label):
        self.rank, self.stage, self.comm, self.parts = rank, stage, comm, parts
        self._what, self._label = what, label
        self.seq, self.done, self.links = -1, False, None

    @property
    def what(self) -> str:
        """(formatted when asked: a replay builds many and prints few)"""
        w = self._what
        if isinstance(w, str):
            return w
        text = " ".join(f"{k}{mb}" for _, _, (k, mb) in self.parts)
        return text + " (posted early)" if w else text

    @property
    def label(self) -> str:
        return label_text(self._label, self.stage)

    def __repr__(self) -> str:
        return f"<{self.what} of rank {self.rank} on {self.comm}>"


def label_text(label, stage: int) -> str:
    """The printable form of a program label: an action, a tuple of them, or a text."""
    if isinstance(label, str):
        return label
    if isinstance(label, tuple):
        return " ".join(a.label(stage) for a in label)
    return label.label(stage)


def comm_name(kind: str, members) -> str:
    return "world" if kind == "world" else f"{kind}[{','.join(map(str, members))}]"


class _Rank:
    """One rank's posting order, built by running its stage's windows as the engine would."""

    def __init__(self, layout: CommLayout, sched, tp: int, s: int, dp: int):
        self.L, self.sched, self.kind = layout, sched, sched.kind
        d, t, w = sched.num_stages, layout.tensor, layout.data
        self.s, self.d, self.first, self.last = s, d, s == 0, s == d - 1
        self.tp, self.dp = tp, dp
        r = lambda i, p, q: rank_of(i, p, q, t, d, w, layout.rank_order)  # noqa: E731
        self.rank = r(tp, s, dp)
        self.prev = None if self.first else r(tp, s - 1, dp)
        self.next = None if self.last else r(tp, s + 1, dp)
        pair = "pair-act" if layout.split_pairs else "pair"
        grads = "pair-grad" if layout.split_pairs else "pair"
        self.comms = {}
        if self.prev is not None:
            self.comms["act-in"] = comm_name(pair, (self.prev, self.rank))
            self.comms["grad-out"] = comm_name(grads, (self.prev, self.rank))
        if self.next is not None:
            self.comms["act-out"] = comm_name(pair, (self.rank, self.next))
            self.comms["grad-in"] = comm_name(grads, (self.rank, self.next))
        groups = {"tp": [r(i, s, dp) for i in range(t)], "dp": [r(tp, s, q) for q in range(w)],
                  "mp": [r(i, p, dp) for p in range(d) for i in range(t)],
                  "tied": sorted({r(tp, p, q) for q in range(w) for p in (0, d - 1)})}
        self.members = {}
        for kind, ranks in groups.items():
            if len(ranks) > 1:
                self.comms[kind] = comm_name(kind, ranks)
                self.members[self.comms[kind]] = ranks
        world = t * d * w
        if world > 1:
            self.comms["world"] = "world"
            self.members["world"] = list(range(world))
        self.tied = layout.tied and d > 1 and s in (0, d - 1)
        self.prog, self.started = [], set()  # started: communicators used (lazy_p2p_init)
        self.label = ""
        self.new_segment()

    # ---- posting -------------------------------------------------------------------------
    def post(self, key, parts, what):
        comm = self.comms[key]
        if parts is not None and self.L.lazy_p2p_init and comm not in self.started:
            self.started.add(comm)
            self.blocking(key, None, INIT)
        op = Op(self.rank, self.s, comm, parts, what, self.label)
        self.prog.append((POST, op, self.label))
        return op

    def wait(self, ops):
        self.prog += [(WAIT, op, self.label) for op in ops]

    def blocking(self, key, parts, what):
        self.wait([self.post(key, parts, what)])

    def coll(self, key, what):
        return [self.post(key, None, what)] if key in self.comms else []

    # ---- the interpreter -----------------------------------------------------------------
    def new_segment(self):
        """`start()` / `eval_batch`: p2p.reset() and a clear stash."""
        self.meta_sent = self.meta_received = False
        m = self.sched.num_microbatches  # header microbatches: Interpreter._is_header
        self.headers = (header_period(self.L.shapes, m), self.sched.first_batch * m)
        self.unverified = None  # a header receive posted and not waited for
        self.inputs, self.grad_in, self.outputs = set(), set(), set()
        self.pending, self.sends = {}, []
        self.reductions, self.gathers, self.showing = {}, {}, False
        self.backwards = {}  # batch -> its backwards run (GradReduction.before_backward)

    def run(self, actions, forward_only=False):
        groups = comm_groups(actions)
        g, i, n = 0, 0, len(actions)
        while i < n:
            a = actions[i]
            self.label = a
            if a.is_comm:
                lo, hi = groups[g]
                g += 1
                ahead = actions[groups[g][0]:groups[g][1]] \
                    if self.L.early_receives and g < len(groups) else ()
                self.label = tuple(actions[lo:hi])
                self.communicate(actions[lo:hi], ahead)
                i = hi
                continue
            if a.is_compute and self.pending:
                key = (RECV_ACT if a.kind == FORWARD else RECV_GRAD, a.mb)
                if key in self.pending:
                    if key == self.unverified:
                        self.unverified = None
                    self.wait([self.pending.pop(key)])
            self.handle(a, forward_only)
            i += 1
        if self.pending or self.sends:  # drain
            self.label = f"end of window ({actions[-1].label(self.s)})" if actions else "end"
            if self.unverified in self.pending:  # Interpreter._verify first
                self.wait([self.pending.pop(self.unverified)])
            self.unverified = None
            for key in list(self.pending):
                self.wait([self.pending.pop(key)])
            self.wait_sends(0)

    def communicate(self, group, ahead):
        sends = []
        for a in group:
            if a.kind == SEND_ACT:
                if not self.meta_sent:
                    self.blocking("act-out", [("send", self.next, ("meta", -1))],
                                  "shape handshake (send)")
                    self.meta_sent = True
                sends.append((self.next, a))
            elif a.kind == SEND_GRAD:
                sends.append((self.prev, a))
        ops = []
        for peer in sorted({p for p, _ in sends}):
            key = "act-out" if peer == self.next else "grad-out"
            acts = [a for p, a in sends if p == peer]
            ops.append(self.post(key, [("send", peer, (a.kind, a.mb)) for a in acts], False))
        if ops:
            self.sends.append(ops)
        for a in group:
            if a.kind in (RECV_ACT, RECV_GRAD):
                self.post_recv(a, early=False)
        for a in ahead:
            if a.kind in (RECV_ACT, RECV_GRAD) and not self.post_recv(a, early=True):
                break
        self.wait_sends(1)

    def post_recv(self, a, early):
        if a.kind == RECV_ACT:
            if a.mb in self.inputs:
                return True
            if not self.meta_received:
                if early:
                    return False
                self.blocking("act-in", [("recv", self.prev, ("meta", -1))],
                              "shape handshake (recv)")
                self.meta_received = True
            if self.unverified is not None:  # Interpreter._verify
                if early:
                    return False
                self.wait([self.pending.pop(self.unverified)])
            self.unverified = (a.kind, a.mb) if is_header(*self.headers, a.mb) else None
            self.inputs.add(a.mb)
            key, peer = "act-in", self.prev
        else:
            if a.mb in self.grad_in:
                return True
            if early and a.mb not in self.outputs:
                return False
            self.grad_in.add(a.mb)
            key, peer = "grad-in", self.next
        self.pending[(a.kind, a.mb)] = self.post(key, [("recv", peer, (a.kind, a.mb))], early)
        return True

    def wait_sends(self, keep):
        while len(self.sends) > keep:
            self.wait(self.sends.pop(0))

    # ---- the handlers (engine.py, batch_step.py, compensation.py) ------------------------
    def handle(self, a, forward_only):
        k = a.kind
        if k in (FORWARD, BACKWARD):
            if k == FORWARD and not forward_only:
                self.wait(self.gathers.pop(a.version, ()))  # wait_weights(slot)
            if k == BACKWARD and self.L.early_reduce:  # buckets start inside the last one
                t = a.mb // self.sched.num_microbatches
                self.backwards[t] = self.backwards.get(t, 0) + 1
                if self.backwards[t] == self.sched.num_microbatches:
                    self.reductions[t] = {"early": self.coll("dp", self._dp_what(t, a))}
            if "tp" in self.comms:
                self.blocking("tp", None, f"tensor-parallel all-reduce in {a}")
            if k == FORWARD:
                self.outputs.add(a.mb)
                if forward_only:
                    self.inputs.discard(a.mb)
            else:
                self.outputs.discard(a.mb)
                self.inputs.discard(a.mb)
                self.grad_in.discard(a.mb)
        elif k == REDUCE:
            t = a.batch
            if self.L.sequence_parallel and "tp" in self.comms:
                self.blocking("tp", None, f"sequence-parallel all-reduce R{t}")
            early = self.reductions.pop(t, {}).get("early", [])
            # what R starts itself: the tail (all-reduced with the gradients) and the
            # sequence-parallel buckets; the distributed optimizer's tail rides with the norm
            rest = not early or not self.L.sharded or self.L.sequence_parallel
            dp = self.coll("dp", self._dp_what(t)) if rest else []
            tied = self.coll("tied", f"tied-embedding all-reduce R{t}") if self.tied else []
            self.reductions[t] = {"dp": early + dp, "tied": tied}
        elif k == NORM:
            t = a.batch
            works = self.reductions[t]
            self.wait(works.pop("dp"))
            if self.first:
                self.wait(works.pop("tied"))
            key = "world" if self.L.sharded else "mp"
            works["norm"] = self.coll(key, f"grad-norm all-reduce N{t}")
        elif k == STEP:
            t = a.batch
            works = self.reductions.pop(t)
            self.wait(works.pop("tied", []))
            self.wait(works.pop("norm"))  # fp16: the inf check reads it on the host
            if self.L.sharded:
                self.publish(self.kind.step_writes_slot(t), f"S{t}")

    def _dp_what(self, t, backward=None):
        what = f"{'reduce-scatter' if self.L.sharded else 'all-reduce'} of the gradients R{t}"
        return what + (f" (buckets started in {backward})" if backward is not None else "")

    def publish(self, slot, why):
        """Compensator.publish on sharded weights: wait for the slot's gather, start the next."""
        self.wait(self.gathers.pop(slot, ()))
        self.gathers[slot] = self.coll("dp", f"all-gather of the new weights into slot {slot} "
                                             f"({why})")

    def view(self, t):
        """Between windows, t steps taken: show_newest (evaluation, a checkpoint), then every
        gather waited (`wait_weights()`)."""
        slot = self.kind.newest_slot(t)
        self.label = f"view after {t} steps"
        if self.L.compensation and not self.showing:
            if self.L.sharded:
                self.wait(self.gathers.pop(slot, ()))
                self.gathers[slot] = self.coll("dp", f"all-gather of W({t}) into slot {slot} "
                                                     "(show_newest)")
                self.wait(self.gathers.pop(slot))
            self.showing = True
        for key in list(self.gathers):
            self.wait(self.gathers.pop(key))

    def resume(self, t):
        """train_batch's `compensation.resume`: the prediction back into the newest slot."""
        if self.showing:
            self.label = f"resume at batch {t}"
            if self.L.sharded:
                self.publish(self.kind.newest_slot(t), "resume")
            self.showing = False

    def share_loss(self):
        self.label = "eval loss"
        for key in ("dp", "mp"):
            if key in self.comms:
                self.blocking(key, None, f"eval loss all-reduce over {key}")


def stage_program(schedule, layout: CommLayout, tp: int, stage: int, dp: int) -> _Rank:
    """The rank (tp, stage, dp)'s program for `schedule` (its materialized windows, in order,
    or an evaluation's one window): `.prog`, `.rank`, `.members` (communicator -> ranks)."""
    sched = schedule.materialized()
    rank = _Rank(layout, sched, tp, stage, dp)
    if not sched.is_training:  # eval_batch: a view (`engine.module`), one window, the loss
        rank.view(sched.first_batch)
        rank.run(sched.window(stage, sched.first_batch), forward_only=True)
        rank.share_loss()
        return rank
    for t in range(sched.first_batch, sched.first_batch + sched.num_batches):
        if layout.views and t > sched.first_batch:
            rank.view(t)
            rank.resume(t)
        rank.run(sched.window(stage, t))
    return rank


__all__ = ["CommLayout", "Op", "INIT", "POST", "WAIT", "comm_groups", "comm_name", "label_text",
           "rank_of", "stage_program"]
