"""A torch_dist save: planned and staged on the main thread, written on it or (--async-save) on a
background thread while training goes on, and published collectively on the main thread.

    save = start_save(save_dir, engine, cfg, grid, view, asynchronous=True)   # at a boundary
    ... training continues; save.writing says whether this rank's files are still being written
    save.finish()        # collective, main thread: every rank's files durable -> `latest` moves

1. Start (collective, main thread): the engine's state as boxes of global tensors (shards.py),
   copied to host memory when the write is asynchronous where the engine would change them
   (`_private`; pinned on CUDA, one device sync), the
   common state (iteration, data position, loss scaler, optimizer step count, config, layout) on
   rank 0, each rank's RNG state, and DCP's global plan (storage.plan_save: one gather).
2. Write (this rank, no collective): DCP writes the rank's boxes into
   `{save}/.tmp-iter_XXXXXXX/__<rank>_0.distcp`, hashing while writing, fsynced. On a background
   thread with --async-save; the engine's buffers are not read by it.
3. Finish (collective, main thread): wait for this rank's write, gather every rank's result; if
   any failed, every rank raises the same one-line error and the temporary directory goes.
   Otherwise rank 0 writes `.metadata` (DCP's, from every rank's results), `common.pt` and
   `checksums.sha256` (hashes computed while writing), fsyncs, renames the directory to
   `iter_XXXXXXX`, fsyncs the parent, writes the files saved beside the iterations (the
   tokenizer) and moves `latest` (files.publish_latest: both or neither) and prunes
   (--keep-last).

A process killed before step 3 leaves only the `.tmp-` directory (removed at the next start,
files.remove_temporary_files); `latest` still names the previous checkpoint.
"""
from __future__ import annotations

import os
import shutil
import threading

import torch

from megatron_2bw.checkpoint.dist.shards import state_shards
from megatron_2bw.checkpoint.dist.storage import (CHECKSUMS, PlannedSave, finish_metadata,
                                                  plan_save, write_files)
from megatron_2bw.checkpoint.files import (TMP_PREFIX, CheckpointError, agree, iteration_dir,
                                           latest_iteration, prune, publish_latest, write_error)
from megatron_2bw.checkpoint.files import write_checkpoint_file
from megatron_2bw.fs import fsync_directory

COMMON = "common.pt"


def tmp_dir(save_dir: str, iteration: int) -> str:
    return os.path.join(save_dir, TMP_PREFIX + os.path.basename(iteration_dir(save_dir,
                                                                              iteration)))


def rng_key(grid) -> str:
    """The DCP object holding one rank's RNG state (restored on the same layout only)."""
    return f"rng.pp{grid.stage:03d}.tp{grid.tp_rank:02d}.dp{grid.dp_rank:03d}"


def rng_state(device) -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.device(device).type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(torch.device(device))
    return state


def nested_tensors(value) -> list:
    """Every tensor in nested lists and dicts (an optimizer's pieces form:
    checkpoint/dist/shards.py)."""
    if isinstance(value, torch.Tensor):
        return [value]
    items = value.values() if isinstance(value, dict) else \
        value if isinstance(value, (list, tuple)) else ()
    return [t for v in items for t in nested_tensors(v)]


def _private(shards: list, engine) -> list:
    """The boxes with private host copies where the background write would otherwise read
    buffers the engine keeps changing: the optimizer's live buffers (whole or pieces), and
    anything on the device (pinned memory, one synchronization on CUDA). A box of a CPU copy the
    state dict made already (PipelineEngine.state_dict clones the weights) stays a view: DCP copies it on the
    writing thread. A copy per box, not per buffer: DCP would copy a view of a buffer again."""
    from dataclasses import replace
    w = engine.weights
    live = {t.untyped_storage().data_ptr() for t in
            nested_tensors([*w.slots, *w.grads, w.master, engine.optimizer.state_dict()])}
    out, device = [], None
    for s in shards:
        t = s.tensor
        if t.device.type == "cuda":
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            host.copy_(t, non_blocking=True)
            device = t.device
        elif t.untyped_storage().data_ptr() in live:
            host = t.clone()
        else:
            host = t
        out.append(replace(s, tensor=host))
    if device is not None:
        torch.cuda.synchronize(device)
    return out


class DistSave:
    """One rank's part of a torch_dist save in progress (see the module docstring). `hooks`: the
    run's fault hooks (pipeline/faults.py `FaultHooks`: `during_save` before the files are
    written), or None."""

    def __init__(self, save_dir: str, iteration: int, grid, planned: PlannedSave, common: dict,
                 keep_last: int, hooks=None, extra_files: dict | None = None,
                 beside: dict | None = None):
        self.save_dir, self.iteration, self.grid = save_dir, iteration, grid
        self.planned, self.common, self.keep_last, self.hooks = planned, common, keep_last, hooks
        self.extra_files = dict(extra_files or {})  # name -> bytes rank 0 writes beside them
        self.beside = dict(beside or {})  # name -> bytes rank 0 writes beside the iterations
        self.results, self.error, self._thread = None, None, None

    def start(self, asynchronous: bool) -> "DistSave":
        if asynchronous:
            self._thread = threading.Thread(target=self._write, daemon=True,
                                            name=f"checkpoint-save-{self.iteration}")
            self._thread.start()
        else:
            self._write()
        return self

    def _write(self) -> None:
        try:
            if self.hooks is not None:
                self.hooks.during_save(self.grid, self.iteration, self.planned.first_file())
            self.results = write_files(self.planned)
        except CheckpointError as e:
            self.error = str(e)
        except OSError as e:
            self.error = write_error(self.planned.first_file(), e, 0)
        except BaseException as e:  # noqa: BLE001 - reported to every rank at finish
            first = str(e).splitlines()[0] if str(e) else ""
            self.error = (f"writing {self.planned.first_file()} failed: {type(e).__name__}: "
                          f"{first}")

    @property
    def writing(self) -> bool:
        """This rank's files are still being written (asynchronous saves only)."""
        return self._thread is not None and self._thread.is_alive()

    def finish(self) -> str:
        """Collective, main thread: publish the checkpoint when every rank's files are durable
        (module docstring, step 3); returns its directory. One CheckpointError, the same on
        every rank, when any rank failed; the previous checkpoint stays `latest`."""
        if self._thread is not None:
            self._thread.join()
        grid, tmp = self.grid, self.planned.directory
        final = iteration_dir(self.save_dir, self.iteration)
        gathered = grid.comm.gather_objects((self.error, self.results, self.planned.digests))
        problem = next((g[0] for g in gathered if g[0]), None)
        if problem is None and grid.rank == 0:
            try:
                self._publish(tmp, final, [g[1] for g in gathered],
                              {k: v for g in gathered for k, v in g[2].items()})
            except (CheckpointError, OSError) as e:
                problem = str(e)
        problem = agree(problem, grid)
        if problem:
            if grid.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                if latest_iteration(self.save_dir) != self.iteration:
                    shutil.rmtree(final, ignore_errors=True)  # no half of an iteration stays
            current = latest_iteration(self.save_dir)
            kept = f"iteration {current}" if current is not None else "none"
            raise CheckpointError(f"{problem}; the previous checkpoint ({kept}) in "
                                  f"{self.save_dir} is intact")
        return final

    def _publish(self, tmp: str, final: str, results: list, digests: dict) -> None:
        digests.update(finish_metadata(self.planned, results))
        digests[COMMON] = write_checkpoint_file(os.path.join(tmp, COMMON),
                                                lambda f: torch.save(self.common, f))
        for name, data in self.extra_files.items():
            digests[name] = write_checkpoint_file(os.path.join(tmp, name),
                                                  lambda f, data=data: f.write(data))
        write_checkpoint_file(os.path.join(tmp, CHECKSUMS), lambda f: f.write("".join(
            f"{digest}  {name}\n" for name, digest in sorted(digests.items())).encode()))
        fsync_directory(tmp)
        if os.path.exists(final):  # a save of this iteration that never became `latest`
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_directory(self.save_dir)
        publish_latest(self.save_dir, self.iteration, self.beside)
        if self.keep_last:
            prune(self.save_dir, self.keep_last)


def start_save(save_dir: str, engine, grid, view, common: dict, save_optim: bool = True,
               keep_last: int = 0, hooks=None, asynchronous: bool = False,
               state: dict | None = None, export=None, beside: dict | None = None) -> DistSave:
    """Collective: stage and plan this rank's part of the save of `engine`'s current iteration
    and start writing it (module docstring, steps 1-2). `view` is the stage's StageBoxes
    (load.py); `common` the state rank 0 writes to common.pt (checkpointing.common_state);
    `state` the engine's state dict when the caller has it already. `export` writes another
    format's names and files from the same boxes (`apply(shards, objects, common)` -> the
    three as written, `files`: name -> bytes; checkpoint/megatron/export.py). `beside`: files
    (name -> bytes) published with it beside the iterations (files.publish_latest)."""
    t = engine.iteration
    tmp = tmp_dir(save_dir, t)
    state = dict(engine.state_dict() if state is None else state)
    if not save_optim:
        state.pop("optimizer", None)
    shards, other = state_shards(state, view.params, view.numel)
    common = dict(common, optimizer=None if not save_optim else other)
    objects = {rng_key(grid): rng_state(engine.device)}
    if export is not None:
        shards, objects, common = export.apply(shards, objects, common)
    if asynchronous:
        shards = _private(shards, engine)
    planned = plan_save(shards, objects, tmp, grid.comm)
    return DistSave(save_dir, t, grid, planned, common, keep_last, hooks,
                    getattr(export, "files", None), beside).start(asynchronous)
