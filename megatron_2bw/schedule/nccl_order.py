"""The NCCL-order validator: replays every rank's posted communication (nccl_posts.py) under
NCCL's semantics and proves that no rank waits forever, or reports the wait cycle.

The semantics replayed:
- each communicator runs a rank's operations in posting order (one stream per communicator):
  an operation starts when every earlier one of that rank on that communicator completed;
- a collective completes when every member has it at the head of its queue on that
  communicator; the k-th collectives of the members must be the same one (else: a mismatch);
- point-to-point parts match in order per (communicator, sender, receiver): the k-th send with
  the k-th receive, which must carry the same microbatch; a batched post (one
  batch_isend_irecv) completes when each of its parts met its partner while both posts were
  running (at the head of their queues); a send never completes before its receive is posted;
- a rank that waits (for a work, or on the host: the fp16 inf check, a blocking send/recv or
  collective) posts nothing after it until the wait is over, on any communicator;
- the first use of a pair communicator is a blocking rendezvous of its two ranks (NCCL may
  create it then: `CommLayout.lazy_p2p_init`, on by default).

`check_nccl_order(schedule, layout)` runs every rank of the layout (tensor x schedule's stages x
data) to its end, or raises `NcclOrderError` whose message names the cycle: each rank in it,
the action it is blocked in, what it waits for on which communicator, and which rank that needs.
`early_receives_safe` is what the engine asks (once per schedule shape and layout, cached):
whether receives may be posted early; where not, the posting at the actions' own positions must
pass (else the error).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from megatron_2bw.schedule.nccl_posts import POST, CommLayout, label_text, stage_program

_PARTNER = {"ra": "sa", "sa": "ra", "rg": "sg", "sg": "rg", "meta": "meta"}


class NcclOrderError(ValueError):
    """The posted communication can deadlock under NCCL (`.cycle`: [(rank, communicator,
    action label, what)]), or does not match across ranks."""

    def __init__(self, message: str, cycle=()):
        super().__init__(message)
        self.cycle = list(cycle)


@dataclass
class NcclReport:
    ranks: int
    communicators: int
    operations: int


class _Replay:
    def __init__(self, schedule, layout: CommLayout, edit=None):
        d, t, w = schedule.num_stages, layout.tensor, layout.data
        self.layout, self.d = layout, d
        self.ranks = {}
        schedule = schedule.materialized()  # once: every rank's program reads its windows
        for tp in range(t):
            for s in range(d):
                for dp in range(w):
                    r = stage_program(schedule, layout, tp, s, dp)
                    self.ranks[r.rank] = r
        if edit is not None:  # tests: reorder a rank's posts (a broken order must be caught)
            edit(self.ranks)
        self.coords = {r.rank: (r.s, r.tp, r.dp) for r in self.ranks.values()}
        self.members = {}
        for r in self.ranks.values():
            self.members.update(r.members)
            for key, peer in (("act-in", r.prev), ("grad-out", r.prev), ("act-out", r.next),
                              ("grad-in", r.next)):
                if key in r.comms:
                    self.members[r.comms[key]] = sorted((r.rank, peer))
        self.queues = {c: {m: [] for m in ms} for c, ms in self.members.items()}
        self.heads = {c: {m: 0 for m in ms} for c, ms in self.members.items()}
        self.colls = {}      # (comm, seq) -> [ops]
        self.coll_count = {}  # (comm, rank) -> collectives posted
        self.chans = {}      # (comm, src, dst) -> ([send parts], [recv parts])
        self.pc = {r: 0 for r in self.ranks}
        self.waiting = {}    # op -> rank blocked on it
        self.posted = 0

    # ---- naming ----------------------------------------------------------------------------
    def rank_name(self, r: int) -> str:
        s, tp, dp = self.coords[r]
        return f"rank {r} (stage {s}, tp {tp}, dp {dp})"

    def op_name(self, op) -> str:
        return f"{op.what} [{op.label}]"

    def wait_label(self, r: int) -> str:
        """The action(s) rank r is blocked in."""
        return label_text(self.ranks[r].prog[self.pc[r]][2], self.coords[r][0])

    # ---- posting ---------------------------------------------------------------------------
    def post(self, op):
        self.posted += 1
        q = self.queues[op.comm][op.rank]
        q.append(op)
        if op.parts is None:
            key = (op.comm, op.rank)
            op.seq = self.coll_count.get(key, 0)
            self.coll_count[key] = op.seq + 1
            same = self.colls.setdefault((op.comm, op.seq), [])
            if same and same[0].what != op.what:
                o = same[0]
                raise NcclOrderError(
                    f"collective order differs on {op.comm}: its collective #{op.seq} is "
                    f"{o.what} on {self.rank_name(o.rank)} [{o.label}] but {op.what} on "
                    f"{self.rank_name(op.rank)} [{op.label}]",
                    [(o.rank, op.comm, o.label, o.what), (op.rank, op.comm, op.label, op.what)])
            same.append(op)
        else:
            op.links = []
            for direction, peer, tag in op.parts:
                src, dst = (op.rank, peer) if direction == "send" else (peer, op.rank)
                sends, recvs = self.chans.setdefault((op.comm, src, dst), ([], []))
                mine, other = (sends, recvs) if direction == "send" else (recvs, sends)
                part = [op, tag, None, False]  # the op, its tag, its partner part, met
                mine.append(part)
                k = len(mine) - 1
                if k < len(other):
                    partner = other[k]
                    if partner[1][1] != tag[1] or _PARTNER[tag[0]] != partner[1][0]:
                        raise NcclOrderError(
                            f"point-to-point order differs on {op.comm}: {self.rank_name(op.rank)}"
                            f" [{op.label}] posts {tag[0]}{tag[1]} as message #{k} from rank "
                            f"{src} to rank {dst}, which {self.rank_name(partner[0].rank)} "
                            f"posted as {partner[1][0]}{partner[1][1]} [{partner[0].label}]",
                            [(op.rank, op.comm, op.label, op.what),
                             (partner[0].rank, op.comm, partner[0].label, partner[0].what)])
                    part[2], partner[2] = partner, part
                op.links.append(part)
        return len(q) - self.heads[op.comm][op.rank] == 1  # it is the head now

    def head(self, comm, r):
        q, h = self.queues[comm][r], self.heads[comm][r]
        return q[h] if h < len(q) else None

    # ---- completion ------------------------------------------------------------------------
    def settle(self, comm, woken):
        """Complete what can complete on `comm`; ranks blocked on a completed op go to `woken`."""
        while True:
            progress = False
            members = self.members[comm]
            heads = {m: self.head(comm, m) for m in members}
            ops = [op for op in heads.values() if op is not None]
            if not ops:
                return
            colls = [op for op in ops if op.parts is None]
            if len(colls) == len(members) and len({op.seq for op in colls}) == 1:
                for op in colls:
                    self.complete(op, woken)
                progress = True
            for op in ops:
                if op.parts is not None and all(self._met(part, heads) for part in op.links):
                    self.complete(op, woken)
                    progress = True
            if not progress:
                return

    @staticmethod
    def _met(part, heads) -> bool:
        """A part met its partner: both posted, both posts at the head of their queues (once
        met, it stays met)."""
        if part[3]:
            return True
        partner = part[2]
        if partner is not None and heads.get(partner[0].rank) is partner[0] \
                and heads.get(part[0].rank) is part[0]:
            part[3] = partner[3] = True
            return True
        return False

    def complete(self, op, woken):
        op.done = True
        self.heads[op.comm][op.rank] += 1
        r = self.waiting.pop(op, None)
        if r is not None:
            woken.append(r)

    # ---- the run ---------------------------------------------------------------------------
    def run(self) -> NcclReport:
        todo, dirty = list(self.ranks), set()
        while todo or dirty:
            while todo:
                r = todo.pop()
                prog, pc = self.ranks[r].prog, self.pc[r]
                while pc < len(prog):
                    kind, op, _ = prog[pc]
                    if kind == POST:
                        if self.post(op):
                            dirty.add(op.comm)
                    elif not op.done:
                        if op.seq < 0 and op.links is None:
                            self.pc[r] = pc
                            raise NcclOrderError(f"{self.rank_name(r)} [{self.wait_label(r)}] "
                                                 f"waits for {op.what} before it posts it")
                        self.waiting[op] = r
                        break
                    pc += 1
                self.pc[r] = pc
            while dirty:
                self.settle(dirty.pop(), todo)
        blocked = [r for r in self.ranks if self.pc[r] < len(self.ranks[r].prog)]
        if blocked:
            raise self.cycle(blocked)
        for comm, qs in self.queues.items():
            for r, q in qs.items():
                if self.heads[comm][r] < len(q):
                    op = q[self.heads[comm][r]]
                    raise NcclOrderError(f"{self.rank_name(r)} [{op.label}] posts {op.what} on "
                                         f"{comm}, which no member matches", [(r, comm, op.label,
                                                                               op.what)])
        return NcclReport(len(self.ranks), len(self.members), self.posted)

    # ---- the report ------------------------------------------------------------------------
    def edges(self, node):
        """[(next node, text)] of what `node` waits for: ("rank", r) blocked in a wait, or
        ("head", r, comm): the op running on r's queue of comm."""
        if node[0] == "rank":
            r = node[1]
            if self.pc[r] >= len(self.ranks[r].prog):
                return []  # it finished without posting what is waited for
            op, label = self.ranks[r].prog[self.pc[r]][1], self.wait_label(r)
            h = self.head(op.comm, r)
            text = f"{self.rank_name(r)} blocks in {label} waiting for {op.what} on {op.comm}"
            if h is not op:
                text += f", queued there behind {self.op_name(h)}"
            return [(("head", r, op.comm), text)]
        _, r, comm = node
        h = self.head(comm, r)
        me = f"{self.rank_name(r)}'s {self.op_name(h)} on {comm}"
        out = []
        if h.parts is None:
            for m in self.members[comm]:
                mine = [o for o in self.colls[(comm, h.seq)] if o.rank == m]
                if m == r or (mine and self.head(comm, m) is mine[0]):
                    continue
                if mine:
                    out.append((("head", m, comm), f"{me} needs {self.rank_name(m)}'s, queued "
                                f"behind {self.op_name(self.head(comm, m))}"))
                else:
                    out.append((("rank", m), f"{me} needs {self.rank_name(m)} to post it"))
        else:
            for part in h.links:
                if part[3]:
                    continue
                partner, tag = part[2], part[1]
                peer = [p for _, p, t_ in h.parts if t_ == tag][0]
                want = _PARTNER[tag[0]] + (str(tag[1]) if tag[1] >= 0 else "")
                if partner is None:
                    out.append((("rank", peer), f"{me} needs {self.rank_name(peer)} to post "
                                f"{want}"))
                else:
                    out.append((("head", peer, comm), f"{me} needs {self.rank_name(peer)}'s "
                                f"{want}, queued behind {self.op_name(self.head(comm, peer))}"))
        return [(n, t) for n, t in out if n[0] == "head" or self.pc[n[1]] <
                len(self.ranks[n[1]].prog)] or out

    def cycle(self, blocked) -> NcclOrderError:
        for start in blocked:
            path, seen = [], {}
            node = ("rank", start)
            while node not in seen:
                nxt = self.edges(node)
                if not nxt:
                    break
                seen[node] = len(path)
                path.append((node, nxt[0][1]))
                node = nxt[0][0]
            else:
                loop = path[seen[node]:]
                cyc = []
                for (n, text) in loop:
                    r = n[1]
                    comm = n[2] if n[0] == "head" else self.ranks[r].prog[self.pc[r]][1].comm
                    label = self.wait_label(r) if n[0] == "rank" else self.head(comm, r).label
                    cyc.append((r, comm, label, text))
                ranks = sorted({c[0] for c in cyc})
                comms = sorted({c[1] for c in cyc})
                lines = "\n".join(f"  {c[3]}" for c in cyc)
                return NcclOrderError(
                    f"NCCL wait cycle over ranks {ranks} on {', '.join(comms)}:\n{lines}\n"
                    f"  -> back to {self.rank_name(cyc[0][0])}", cyc)
        names = "; ".join(f"{self.rank_name(r)} in {self.wait_label(r)}" for r in blocked)
        return NcclOrderError(f"ranks wait on operations no one will post: {names}",
                              [(r, None, None, None) for r in blocked])


def check_nccl_order(schedule, layout: CommLayout | None = None, edit=None) -> NcclReport:
    """Replay `schedule` (its materialized windows) on every rank of `layout` under NCCL's
    semantics; raise `NcclOrderError` (the cycle, printed) if any rank could wait forever.
    `edit(ranks)` (tests) may change the programs ({rank: .prog}) before the replay."""
    return _Replay(schedule, layout or CommLayout(), edit).run()


_VERDICTS: dict = {}


def early_receives_safe(schedule, layout: CommLayout) -> bool:
    """Whether the engine may post receives early for `schedule` on `layout` (proved by
    `check_nccl_order`); False: post each at its action's own position, which must then pass
    (else its `NcclOrderError`). Cached per (schedule shape, layout); a custom table per object."""
    key = (schedule.shape, layout) if schedule.shape is not None else (id(schedule), layout)
    verdict = _VERDICTS.get(key)
    if verdict is None:
        early = replace(layout, early_receives=True)
        try:
            check_nccl_order(schedule, early)
            verdict = True
        except NcclOrderError:
            try:
                check_nccl_order(schedule, replace(layout, early_receives=False))
                verdict = False
            except NcclOrderError as e:
                verdict = e
        if schedule.shape is not None:
            _VERDICTS[key] = verdict
    if isinstance(verdict, NcclOrderError):
        raise NcclOrderError(f"{schedule!r} can deadlock under NCCL: {verdict}", verdict.cycle)
    return verdict


__all__ = ["CommLayout", "NcclOrderError", "NcclReport", "check_nccl_order",
           "early_receives_safe"]
