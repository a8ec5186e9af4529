"""`deepspeed.runtime.pipe.schedule`: DeepSpeed's schedules as a view of our action tables.

`TrainSchedule(micro_batches, stages, stage_id)` reads stage `stage_id`'s table of the `flush`
kind (schedule/generators.py: 1F1B, one batch) and `InferenceSchedule` the `forward` kind's, and
lays them out on DeepSpeed's step grid, yielding one list of `PipeInstruction`s per step, as
DeepSpeed's engine consumes them:

- every compute action of a table goes on the earliest step after the stage's previous one and
  after the step that produced its input (F(k) on the stage before, B(k) on the stage after, F(k)
  itself on the last stage); in training forwards keep the steps of one parity and backwards the
  other (stage s forwards on steps of s's parity): DeepSpeed's 2 * (m + d - 1) steps, m + d - 1
  in inference;
- a receive joins the step of the compute that consumes it; a send goes one step after the compute
  that produced it, the step where the neighbour receives it;
- the first and the last stage load a micro-batch on each of their forward steps;
- the table's R (gradient reduction) is `ReduceTiedGrads` + `ReduceGrads` and its S
  `OptimizerStep`, on the last step of the grid; N (the global norm) has no instruction
  (DeepSpeed clips inside its step);
- buffer ids are micro-batch mod `num_pipe_buffers()`: the stage's peak in flight of the table (at
  least 2) in training, 2 in inference.

Where our flush order differs from DeepSpeed's: not in compute (both are 1F1B: d - s forwards
before stage s's first backward, then one forward one backward, then the remaining backwards).
Our table sends right after the compute that produced a tensor and posts adjacent sends and
receives as one batched group (sa(k) rg(j) after F(k), sg(j) ra(k+1) after B(j)); DeepSpeed's
blocking sends wait one step and pair with that step's receive, forward steps sending before
receiving and backward steps receiving before sending, so that neighbours on opposite parities
match up. The messages of a step are the same; only the posting order inside a group differs,
which a batched post makes irrelevant. Our R reduces tied and data-parallel gradients in one
action; DeepSpeed names the two.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from megatron_2bw.deepspeed.runtime.utils import call_to_str
from megatron_2bw.schedule.actions import (BACKWARD, FORWARD, RECV_ACT, RECV_GRAD, REDUCE,
                                           SEND_ACT, SEND_GRAD, STEP)
from megatron_2bw.schedule.kinds import FORWARD_ONLY, schedule_kind
from megatron_2bw.schedule.tables import count_in_flight


class PipeInstruction:
    """One instruction of a step; keyword arguments become attributes (DeepSpeed's contract)."""

    def __init__(self, **kwargs):
        self.name = self.__class__.__name__
        self.kwargs = kwargs
        self.__dict__.update(kwargs)

    def __repr__(self):
        return call_to_str(self.name, **self.kwargs)

    def __eq__(self, other):
        return type(self) is type(other) and self.kwargs == other.kwargs

    def __hash__(self):
        return hash((self.name, tuple(sorted(self.kwargs.items()))))


class OptimizerStep(PipeInstruction):
    """Step the optimizer and zero the gradients (after the two reductions)."""


class ReduceGrads(PipeInstruction):
    """All-reduce the stage's gradients over its data-parallel replicas."""


class ReduceTiedGrads(PipeInstruction):
    """Sum the gradients of tied weights over the stages that hold a copy."""


class BufferOpInstruction(PipeInstruction):
    """An instruction on pipeline buffer `buffer_id`."""

    def __init__(self, buffer_id, **kwargs):
        super().__init__(buffer_id=buffer_id, **kwargs)


class LoadMicroBatch(BufferOpInstruction):
    """Read the next micro-batch into a buffer (first stage: inputs, last stage: labels)."""


class ForwardPass(BufferOpInstruction):
    """Forward of the buffer's micro-batch."""


class BackwardPass(BufferOpInstruction):
    """Backward of the buffer's micro-batch, accumulating gradients."""


class SendActivation(BufferOpInstruction):
    """Send the buffer's output to the next stage."""


class RecvActivation(BufferOpInstruction):
    """Receive the previous stage's output into a buffer."""


class SendGrad(BufferOpInstruction):
    """Send the gradient of the buffer's input to the previous stage."""


class RecvGrad(BufferOpInstruction):
    """Receive the gradient of the buffer's output from the next stage."""


_COMM = {RECV_ACT: RecvActivation, SEND_ACT: SendActivation,
         RECV_GRAD: RecvGrad, SEND_GRAD: SendGrad}


class PipeSchedule(ABC):
    """A generator of steps (lists of instructions) for one stage of one batch."""

    def __init__(self, micro_batches, stages, stage_id):
        super().__init__()
        self.micro_batches = micro_batches
        self.stages = stages
        self.stage_id = stage_id
        self.prev_stage = self.stage_id - 1
        self.next_stage = self.stage_id + 1

    @abstractmethod
    def steps(self):
        """Yield the list of instructions of each step."""

    def num_pipe_buffers(self):
        return self.micro_batches

    def _valid_micro_batch(self, micro_batch_id):
        return 0 <= micro_batch_id < self.micro_batches

    def _valid_stage(self, stage_id):
        return 0 <= stage_id < self.stages

    def _buffer_idx(self, micro_batch_id):
        assert self._valid_micro_batch(micro_batch_id), micro_batch_id
        return micro_batch_id % self.num_pipe_buffers()

    @property
    def stage(self):
        return self.stage_id

    @property
    def num_stages(self):
        return self.stages

    @property
    def num_micro_batches(self):
        return self.micro_batches

    @property
    def is_first_stage(self):
        return self.stage_id == 0

    @property
    def is_last_stage(self):
        return self.stage_id == self.stages - 1

    def __iter__(self):
        return iter(self.steps())


def _compute_steps(tables: list, alternate: bool) -> list:
    """The step of every compute action of every stage's table: the earliest step after the
    stage's previous compute and after the step its input was produced on (F(k) on stage s - 1,
    B(k) on stage s + 1, or F(k) on the last stage), on the parity of its kind if `alternate`."""
    d = len(tables)
    done = [{} for _ in range(d)]            # stage -> {(kind, mb): step}
    computes = [[a for a in t if a.kind in (FORWARD, BACKWARD)] for t in tables]
    nxt, last = [0] * d, [s - 1 for s in range(d)]
    while any(nxt[s] < len(computes[s]) for s in range(d)):
        moved = False
        for s in range(d):
            while nxt[s] < len(computes[s]):
                a = computes[s][nxt[s]]
                if a.kind == FORWARD:
                    dep = done[s - 1].get((FORWARD, a.mb)) if s > 0 else -1
                elif s < d - 1:
                    dep = done[s + 1].get((BACKWARD, a.mb))
                else:
                    dep = done[s].get((FORWARD, a.mb))
                if dep is None:
                    break
                # `tick`: DeepSpeed's instruction-step clock (forwards on even ticks of a stage,
                # backwards on odd ones), not a batch index: no weight-version rule here
                tick = max(last[s], dep) + 1
                if alternate and (tick - s) % 2 != (0 if a.kind == FORWARD else 1):
                    tick += 1
                done[s][(a.kind, a.mb)] = last[s] = tick
                nxt[s] += 1
                moved = True
        if not moved:
            raise ValueError("the table has a compute action whose input is never produced")
    return done


def _place(actions: list, steps: dict) -> list:
    """(step, action) for one stage: compute on its step, receives with their consumer, sends
    one step after their producer, R / N / S on the grid's last step (None)."""
    placed, pending, step = [], [], None
    for a in actions:
        if a.kind in (RECV_ACT, RECV_GRAD):
            pending.append(a)
        elif a.kind in (SEND_ACT, SEND_GRAD):
            placed.append((step + 1, a))
        elif a.kind in (FORWARD, BACKWARD):
            step = steps[(a.kind, a.mb)]
            placed += [(step, r) for r in pending] + [(step, a)]
            pending = []
        else:
            placed.append((None, a))
    return placed


class _TableView(PipeSchedule):
    kind = ""
    alternate = False

    def _table(self, stage):
        return schedule_kind(self.kind).stage_actions(stage, self.stages, self.micro_batches,
                                                      1, 0)

    def _grid(self):
        """One dict per step: 'send', 'recv', 'load', 'compute', 'end' instruction lists."""
        tables = [self._table(s) for s in range(self.stages)]
        steps = _compute_steps(tables, self.alternate)
        placed = _place(tables[self.stage_id], steps[self.stage_id])
        length = 1 + max(max(done.values()) for done in steps)
        grid = [{"send": [], "recv": [], "load": [], "compute": [], "end": []}
                for _ in range(length)]
        edge = self.is_first_stage or self.is_last_stage
        for step, a in placed:
            if a.kind in _COMM:
                grid[step]["send" if a.kind in (SEND_ACT, SEND_GRAD) else "recv"].append(
                    _COMM[a.kind](self._buffer_idx(a.mb)))
            elif a.kind == FORWARD:
                if edge:
                    grid[step]["load"].append(LoadMicroBatch(self._buffer_idx(a.mb)))
                grid[step]["compute"].append(ForwardPass(self._buffer_idx(a.mb)))
            elif a.kind == BACKWARD:
                grid[step]["compute"].append(BackwardPass(self._buffer_idx(a.mb)))
            elif a.kind == REDUCE:
                grid[-1]["end"] += [ReduceTiedGrads(), ReduceGrads()]
            elif a.kind == STEP:
                grid[-1]["end"].append(OptimizerStep())
        return grid


class TrainSchedule(_TableView):
    """One training batch of the `flush` kind (1F1B) in DeepSpeed's steps."""
    kind = "flush"
    alternate = True

    def steps(self):
        for index, cell in enumerate(self._grid()):
            forward_step = (index - self.stage_id) % 2 == 0
            comm = (cell["send"] + cell["recv"] if forward_step
                    else cell["recv"] + cell["send"])
            yield comm + cell["load"] + cell["compute"] + cell["end"]

    def num_pipe_buffers(self):
        return max(2, count_in_flight(self._table(self.stage_id)))


class InferenceSchedule(_TableView):
    """The `forward` kind (eval) in DeepSpeed's steps: even stages send before they receive, odd
    stages receive before they send."""
    kind = FORWARD_ONLY

    def steps(self):
        for cell in self._grid():
            comm = (cell["send"] + cell["recv"] if self.stage_id % 2 == 0
                    else cell["recv"] + cell["send"])
            yield cell["load"] + comm + cell["compute"]

    def num_pipe_buffers(self):
        return 2


class DataParallelSchedule(PipeSchedule):
    """Plain gradient accumulation on one stage (DeepSpeed's example schedule)."""

    def steps(self):
        for step_id in range(self.micro_batches):
            cmds = [LoadMicroBatch(buffer_id=0), ForwardPass(buffer_id=0),
                    BackwardPass(buffer_id=0)]
            if step_id == self.micro_batches - 1:
                cmds += [ReduceGrads(), OptimizerStep()]
            yield cmds

    def num_pipe_buffers(self):
        return 1


__all__ = ["BackwardPass", "BufferOpInstruction", "DataParallelSchedule", "ForwardPass",
           "InferenceSchedule", "LoadMicroBatch", "OptimizerStep", "PipeInstruction",
           "PipeSchedule", "RecvActivation", "RecvGrad", "ReduceGrads", "ReduceTiedGrads",
           "SendActivation", "SendGrad", "TrainSchedule"]
