"""Pipeline actions: the vocabulary every schedule is written in.

A schedule is, for each stage, an ordered list of `Action`s. The engine runs them, the simulator
times them, the timeline draws them. Short printable forms (the stage prefix is added by
`Action.label(stage)`):

    F3v0   forward of microbatch 3 on weight version slot 0
    B3v0   backward of microbatch 3 on weight version slot 0
    ra3    receive the activation of microbatch 3 from the previous stage
    sa3    send the activation of microbatch 3 to the next stage
    rg3    receive the gradient of microbatch 3 from the next stage
    sg3    send the gradient of microbatch 3 to the previous stage
    R2     start the data-parallel (and tied-weight) gradient reduction of batch 2 (async)
    N2     finish that reduction locally and start the global norm/loss reduction of batch 2 (async)
    S2     optimizer step of batch 2 (waits for both reductions)

Consecutive communication actions (ra/sa/rg/sg) form one group: they are posted together as one
batched isend/irecv and all complete before the next non-communication action runs.
"""
from __future__ import annotations

from dataclasses import dataclass

FORWARD = "F"
BACKWARD = "B"
RECV_ACT = "ra"
SEND_ACT = "sa"
RECV_GRAD = "rg"
SEND_GRAD = "sg"
REDUCE = "R"
NORM = "N"
STEP = "S"

COMPUTE_KINDS = (FORWARD, BACKWARD)
COMM_KINDS = (RECV_ACT, SEND_ACT, RECV_GRAD, SEND_GRAD)
BATCH_KINDS = (REDUCE, NORM, STEP)
ALL_KINDS = COMPUTE_KINDS + COMM_KINDS + BATCH_KINDS


@dataclass(frozen=True)
class Action:
    kind: str
    mb: int = -1        # microbatch index (global over the run) for F/B/comm actions
    version: int = -1   # weight-version slot for F/B
    batch: int = -1     # batch index for R/N/S

    def __post_init__(self):
        if self.kind not in ALL_KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; expected one of {ALL_KINDS}")

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    def __str__(self) -> str:
        if self.kind in COMPUTE_KINDS:
            return f"{self.kind}{self.mb}v{self.version}"
        if self.kind in COMM_KINDS:
            return f"{self.kind}{self.mb}"
        return f"{self.kind}{self.batch}"

    def label(self, stage: int) -> str:
        return f"{stage}{self}"

    def shifted(self, mb_offset: int, batch_offset: int, version_of_batch) -> "Action":
        """The same action `batch_offset` batches later (used to repeat a steady-state window)."""
        if self.kind in BATCH_KINDS:
            return Action(self.kind, batch=self.batch + batch_offset)
        mb = self.mb + mb_offset
        if self.kind in COMPUTE_KINDS:
            return Action(self.kind, mb=mb, version=version_of_batch(mb))
        return Action(self.kind, mb=mb)


def F(mb: int, version: int) -> Action:
    return Action(FORWARD, mb=mb, version=version)


def B(mb: int, version: int) -> Action:
    return Action(BACKWARD, mb=mb, version=version)


def RA(mb: int) -> Action:
    return Action(RECV_ACT, mb=mb)


def SA(mb: int) -> Action:
    return Action(SEND_ACT, mb=mb)


def RG(mb: int) -> Action:
    return Action(RECV_GRAD, mb=mb)


def SG(mb: int) -> Action:
    return Action(SEND_GRAD, mb=mb)


def R(batch: int) -> Action:
    return Action(REDUCE, batch=batch)


def N(batch: int) -> Action:
    return Action(NORM, batch=batch)


def S(batch: int) -> Action:
    return Action(STEP, batch=batch)


# Which activation messages carry a shape header (parallel/p2p.py "Shapes"), by how a run's
# shapes may change: "fixed" never (the pretrain scripts: every batch is [b, --seq-length]; no
# header, a change is refused in one line), "batch" between batches (DeepSpeed's default: the
# first microbatch of every batch after the run's first), "microbatch" at any microbatch
# (DeepSpeed's dynamic_shape=True: every one after the run's first).
SHAPE_MODES = ("fixed", "batch", "microbatch")


def shape_mode(dynamic_shape) -> str:
    """A SHAPE_MODES name from DeepSpeed's dynamic_shape (True/False) or a mode's name."""
    if isinstance(dynamic_shape, str):
        if dynamic_shape not in SHAPE_MODES:
            raise ValueError(f"unknown shape mode {dynamic_shape!r}: use one of {SHAPE_MODES}")
        return dynamic_shape
    return "microbatch" if dynamic_shape else "batch"


def header_period(mode: str, m: int) -> int:
    """Microbatches between two headers for `mode` at m microbatches per batch (0: none)."""
    return {"fixed": 0, "batch": m, "microbatch": 1}[mode]


def is_header(period: int, first: int, mb: int) -> bool:
    """Whether microbatch `mb` carries a header (`first`: the run's first microbatch)."""
    return bool(period) and mb % period == 0 and mb != first


def parse(text: str) -> Action:
    """Inverse of str(action): 'F3v0', 'ra3', 'S2'."""
    for kind in sorted(ALL_KINDS, key=len, reverse=True):
        if text.startswith(kind):
            rest = text[len(kind):]
            if kind in COMPUTE_KINDS:
                mb, _, v = rest.partition("v")
                return Action(kind, mb=int(mb), version=int(v))
            if kind in COMM_KINDS:
                return Action(kind, mb=int(rest))
            return Action(kind, batch=int(rest))
    raise ValueError(f"cannot parse action {text!r}")
