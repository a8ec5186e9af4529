"""--profile: a `torch.profiler` trace of a few iterations on chosen ranks (Megatron's flags).

    --profile --profile-step-start N --profile-step-end M --profile-ranks R ...

Each rank of --profile-ranks records iterations N+1 .. M (the iterations after N up to M, as
Megatron counts them; iteration N itself is the profiler's warm-up, not recorded) and writes one
Chrome/Perfetto JSON trace:

    {tensorboard-dir or save or .}/profile/rank{R}.iter{N+1}-{M}.pt.trace.json

(open it in https://ui.perfetto.dev or chrome://tracing; under --tensorboard-dir the PyTorch
profiler plugin of TensorBoard finds it as the run "profile"). While recording, the engine names
every action a range (`PipelineEngine.profile_actions`: F3v0, B3v0, R2, N2, S2, p2p groups as
"sa3 rg1"), so the kernels, collectives and copies appear inside the action that issued them, and
each iteration is a `ProfilerStep#k` range. Outside those iterations nothing is recorded and the
engine runs without ranges. The engine's own --trace (tools/plot_schedule.py --trace) is separate
and unchanged.

A resumed run past N records from its first iteration (without warm-up); a run that ends before M
writes what it recorded when training ends.
"""
from __future__ import annotations

import os

import torch


def profile_path(train, rank: int, first: int, last: int) -> str:
    base = train.tensorboard_dir or train.save or "."
    return os.path.join(base, "profile", f"rank{rank}.iter{first}-{last}.pt.trace.json")


class StepProfiler:
    """Call `step(it)` after every iteration `it` and once before the first with the iteration
    the run starts from; `close()` when training ends. Does nothing off --profile-ranks."""

    def __init__(self, train, grid, engine, start_iteration: int):
        self.engine, self.prof, self.path = engine, None, None
        first = max(train.profile_step_start, start_iteration) + 1
        last = train.profile_step_end
        self.on = train.profile and grid.rank in train.profile_ranks and first <= last
        if not self.on:
            return
        self.warmup = 1 if first - 1 > start_iteration else 0
        self.begin_after = first - 1 - self.warmup   # the iteration after which recording starts
        self.last = last
        self.path = profile_path(train, grid.rank, first, last)
        self.device = engine.device

    def step(self, iteration: int) -> None:
        if not self.on:
            return
        if self.prof is None:
            if iteration == self.begin_after:
                self._start()
            return
        if iteration >= self.last:
            self._synchronize()  # the recorded kernels have run before the trace is written
        self.prof.step()
        if iteration >= self.last:
            self.close()

    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        active = self.last - self.begin_after - self.warmup
        self.prof = profile(activities=activities, record_shapes=True,
                            schedule=schedule(wait=0, warmup=self.warmup, active=active, repeat=1),
                            on_trace_ready=lambda p: p.export_chrome_trace(self.path))
        self.prof.start()
        self.engine.profile_actions(True)

    def close(self) -> None:
        """Stop recording (writing the trace of the iterations recorded so far)."""
        if self.prof is not None:
            self.engine.profile_actions(False)
            self._synchronize()
            self.prof.stop()
            self.prof = None
        self.on = False

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # once, at the end of the profile
