"""The files of a checkpoint directory and the rules that keep them whole:

    {dir}/latest_checkpointed_iteration.txt             the newest complete iteration
    --ckpt-format torch (Megatron's layout, one file per stage and tensor rank):
    {dir}/iter_0000100/mp_rank_00/model_optim_rng.pt    one stage's state (+ .sha256 beside it)
    {dir}/iter_0000100/mp_rank_00_001/...               tensor rank 0, stage 1 (d > 1)
    {dir}/iter_0000100/mp_rank_00/distrib_optim_dp002.pt  data-parallel rank 2's optimizer shard
                                                        (--use-distributed-optimizer; the
                                                        stage file then holds no optimizer)
    --ckpt-format torch_dist (layout-free, dist/ package):
    {dir}/iter_0000100/.metadata, __<rank>_0.distcp     DCP's files
    {dir}/iter_0000100/checksums.sha256                 the sha256 of each, computed while writing
    {dir}/.tmp-iter_0000100/                            a torch_dist save in progress, renamed to
                                                        iter_0000100 once every rank's files are
                                                        durable
    {dir}/.../.tmp-XXXXXX                               a write in progress (TMP_PREFIX)
    {dir}/tokenizer_args.json, tokenizer.model          what the run saved beside its
                                                        iterations (`write_beside`, with the
                                                        save, before `latest` moves:
                                                        convert/tokenizers.py)
    DeepSpeed's pipeline engine (read only; checkpoint/deepspeed_pipe/):
    {dir}/latest                                        the tag of its newest save (DS_LATEST)
    {dir}/global_step100/                               that save: the iteration directory
                                                        (Megatron-DeepSpeed also writes
                                                        latest_checkpointed_iteration.txt)

- Every file is written to a `.tmp-` name next to it, fsynced and renamed over the target (fs.py),
  so a reader sees the old file or the new one, never half of one. A writer killed mid-write leaves
  only a `.tmp-` file, which `remove_temporary_files` deletes at the next start.
- A failed write (disk full, quota, permissions) is one CheckpointError naming the file, the
  bytes written and the OS error (torch.save would report "unexpected pos" instead).
- `latest` names an iteration only after every stage's file of it is complete.
- Loading: every rank loads the iteration `latest` names, agreed in one reduction
  (`agreed_latest`: ranks that see another `latest` or no iteration directory stop with one
  line); each file is hashed once per job, by one of the ranks that read it, before anything
  unpickles it, and the verdict is shared (`verify_once`); a process hashes a file at most once
  (`file_digest` caches by path, inode, size and times).
"""
from __future__ import annotations

import glob
import hashlib
import os
import re
import shutil
from typing import Callable

from megatron_2bw import fs
from megatron_2bw.config import ConfigError

LATEST = "latest_checkpointed_iteration.txt"
FILENAME = "model_optim_rng.pt"
DS_LATEST = "latest"  # DeepSpeed's: the tag of its newest save


def optimizer_shard_name(dp_rank: int) -> str:
    """The file of a data-parallel rank's distributed-optimizer shard, next to FILENAME."""
    return f"distrib_optim_dp{dp_rank:03d}.pt"


TMP_PREFIX = fs.TMP_PREFIX


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used or written; the message names the file and the fix."""


def agree(problem: str | None, grid) -> str | None:
    """Collective: the first rank's problem (in rank order), the same on every rank."""
    return next((p for p in grid.comm.gather_objects(problem) if p), None)


def iteration_dir(root: str, iteration: int) -> str:
    """root/iter_XXXXXXX, or the DeepSpeed save that DeepSpeed's `latest` names when it is of
    this iteration and no iter_XXXXXXX exists (saves are always of an iteration newer than
    latest_iteration, which counts that save)."""
    path = os.path.join(root, f"iter_{iteration:07d}")
    if not os.path.isdir(path):
        tag = deepspeed_tag(root)
        if tag is not None and tag[1] == iteration:
            return tag[0]
    return path


def deepspeed_tag(directory: str) -> tuple[str, int] | None:
    """(the tag directory, its iteration) that DeepSpeed's `latest` in `directory` names, when
    that directory holds DeepSpeed's *model_states.pt files; else None. The iteration is N of
    its global_stepN name (DeepSpeed's own), else the one its first state file records
    (Megatron-DeepSpeed's client state "iteration", else DeepSpeed's global_steps)."""
    path = os.path.join(directory, DS_LATEST)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        tag = f.read().strip()
    target = os.path.join(directory, tag)
    if not tag or not os.path.isdir(target) or \
            not glob.glob(os.path.join(target, "*model_states.pt")):
        return None
    m = re.fullmatch(r"global_step(\d+)", os.path.basename(tag))
    if m:
        return target, int(m.group(1))
    from megatron_2bw.checkpoint.megatron.pickles import load_megatron_file
    state = os.path.join(target, "mp_rank_00_model_states.pt")
    try:
        record = load_megatron_file(state, mmap=True)
        return target, int(record.get("iteration", record["global_steps"]))
    except Exception:  # noqa: BLE001 - damaged or missing: the reader words it
        raise CheckpointError(f"{path} names the DeepSpeed tag {tag!r}, whose {state} cannot "
                              "be read for its iteration: it is missing, truncated or "
                              "corrupted; load another tag") from None


def rank_dir(root: str, iteration: int, tp: int, pp: int, num_stages: int) -> str:
    name = f"mp_rank_{tp:02d}" if num_stages == 1 else f"mp_rank_{tp:02d}_{pp:03d}"
    return os.path.join(iteration_dir(root, iteration), name)


def write_checkpoint_file(path: str, write) -> str:
    """fs.atomic_write (write(file) to a temporary sibling, fsync, rename; returns the sha256),
    with a failed write as one CheckpointError naming the file, the bytes written and the fix;
    `path` is left as it was."""
    try:
        return fs.atomic_write(path, write)
    except fs.WriteError as e:
        raise CheckpointError(write_error(path, e.cause, e.written)) from None


def write_error(path: str, e: OSError, written: int) -> str:
    return fs.write_problem(f"checkpoint file {path}", e, written, where="--save")


def sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_with_checksum(path: str, write) -> None:
    """write_checkpoint_file(path, write) and then its `.sha256` sidecar (hashed while writing)."""
    digest = write_checkpoint_file(path, write)
    write_checkpoint_file(path + ".sha256",
                          lambda f: f.write(f"{digest}  {os.path.basename(path)}\n".encode()))


_DIGESTS: dict[tuple, str] = {}  # a file's identity -> the sha256 this process computed


def file_digest(path: str) -> str:
    """sha256_of(path), computed at most once per process for one version of the file (keyed by
    its real path, inode, size, mtime and ctime: a rewritten file is hashed again)."""
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key not in _DIGESTS:
        _DIGESTS[key] = sha256_of(path)
    return _DIGESTS[key]


def verify_checksum(path: str) -> None:
    """Compare a checkpoint file with its `.sha256` sidecar; one-line error naming the file."""
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint file {path} is missing: the checkpoint is "
                              "incomplete; load an earlier iteration")
    side = path + ".sha256"
    if not os.path.exists(side):
        raise CheckpointError(f"checkpoint file {path} has no checksum ({side} is missing): the "
                              "save did not finish; load an earlier iteration")
    want = (open(side).read().split() or [""])[0]
    if file_digest(path) != want:
        raise CheckpointError(f"checkpoint file {path} does not match its checksum: it is "
                              "truncated or corrupted; load an earlier iteration")


def read_checkpoint_file(path: str, weights_only: bool = True, verify: bool = True):
    """torch.load of a checkpoint file onto the CPU, after verify_checksum when `verify`; a file
    that does not unpickle is one CheckpointError naming it."""
    import torch
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint file {path} is missing: the checkpoint is "
                              "incomplete; load an earlier iteration")
    if verify:
        verify_checksum(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a damaged file
        raise CheckpointError(f"cannot read checkpoint file {path} ({type(e).__name__}): it is "
                              "truncated or corrupted; load an earlier iteration") from None


def problem_of(check: Callable[[], None]) -> str | None:
    """The CheckpointError message `check()` raises, or None."""
    try:
        check()
    except CheckpointError as e:
        return str(e)
    return None


def verify_once(paths: list[str], grid, check: Callable[[str], str | None],
                problem: str | None = None, shared: bool = False) -> None:
    """Collective: every file some rank is about to read (`paths`: this rank's) is checked by
    one rank only, one of its readers (the i-th file in name order by its (i mod n)-th of n
    readers, which spreads the hashing), and every rank gets every verdict. `check(path)`: the
    problem with it, or None. `shared`: every rank passes the same paths (the lists are not
    gathered). `problem`: an error this rank already has; passing it here keeps every rank in
    the same collectives. Raises the first problem in rank order, the same on every rank.
    Costs one gather of the lists (none when shared) and one of the verdicts."""
    comm = grid.comm
    world = comm.world_size if comm.distributed else 1
    if shared:
        readers = {p: list(range(world)) for p in paths}
    else:
        readers = {}
        for rank, (theirs, listed) in enumerate(comm.gather_objects((problem, sorted(paths)))):
            problem = problem or theirs
            for p in listed:
                readers.setdefault(p, []).append(rank)
    if problem is None:
        rank = comm.rank if comm.distributed else 0
        mine = [p for i, p in enumerate(sorted(readers))
                if readers[p][i % len(readers[p])] == rank]
        problem = next((x for x in map(check, mine) if x), None)
    first = agree(problem, grid)
    if first:
        raise CheckpointError(first)


def dangling_latest(directory: str, iteration: int) -> str | None:
    """The problem when `latest` names an iteration whose directory does not exist, else None."""
    target = iteration_dir(directory, iteration)
    if os.path.isdir(target):
        return None
    have = [os.path.basename(iteration_dir(directory, i)) for i in iterations(directory)]
    holds = f"it holds {', '.join(have)}" if have else "it holds no iteration directory"
    return (f"{os.path.join(directory, LATEST)} names iteration {iteration} but "
            f"{os.path.basename(target)} does not exist in {directory} ({holds}): write an "
            f"existing iteration into {LATEST}, or load another directory")


def _seen(code: float) -> str:
    code = int(code)
    return {-1: f"no {LATEST}", -2: f"an unreadable {LATEST}"}.get(code, f"iteration {code}")


def agreed_latest(directory: str, grid) -> int | None:
    """Collective, one reduction: the iteration `latest` in `directory` names, which every rank
    must see alike (None: no checkpoint). Ranks whose views differ (a node-local or stale view of
    the filesystem) or a `latest` naming an iteration that does not exist stop every rank with
    one line."""
    problem = None
    try:
        t = latest_iteration(directory)
        code = -1 if t is None else t
        problem = None if t is None else dangling_latest(directory, t)
    except CheckpointError as e:
        t, code, problem = None, -2, str(e)
    comm = grid.comm
    hi, low, missing = comm.reduce_floats([float(code), -float(code), float(bool(problem))],
                                          op="max")
    if hi != -low:
        raise CheckpointError(f"the ranks see different {LATEST} in {directory}: "
                              f"{_seen(-low)} on some, {_seen(hi)} on others (this rank: "
                              f"{_seen(code)}): a node-local or stale view of the filesystem; "
                              "pass --load a directory on a filesystem every node sees alike")
    if missing:
        raise CheckpointError(problem or f"{os.path.join(directory, LATEST)} names iteration "
                              f"{t}, whose directory another rank does not see: pass --load a "
                              "directory on a filesystem every node sees alike")
    return t


def latest_iteration(directory: str) -> int | None:
    """The iteration named by `latest`, or by DeepSpeed's (`deepspeed_tag`) where that is newer
    (a directory both wrote: nothing is ever saved over the newer), or None when the directory
    holds no checkpoint yet."""
    path = os.path.join(directory, LATEST)
    tag = deepspeed_tag(directory)
    theirs = None if tag is None else tag[1]
    if not os.path.exists(path):
        return theirs
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path} does not hold an iteration number ({text!r}): fix or "
                              "delete it")
    return int(text) if theirs is None else max(int(text), theirs)


def write_latest(directory: str, iteration: int) -> None:
    """Point `latest` at `iteration`; it only ever moves forward."""
    current = latest_iteration(directory)
    if current is not None and iteration <= current:
        raise CheckpointError(not_newer(directory, iteration, current))
    write_checkpoint_file(os.path.join(directory, LATEST),
                          lambda f: f.write(f"{iteration}\n".encode()))


def write_beside(directory: str, files: dict[str, bytes]) -> Callable[[], None]:
    """Write `files` (name -> bytes, in order) into `directory` beside its iterations, each
    atomically (fs.py), leaving a file that holds these bytes already untouched. A save calls it
    before `latest` moves; it returns the undo that puts back what was there (a save that fails
    after it leaves the directory as it found it)."""
    undo = []
    for name, data in files.items():
        path = os.path.join(directory, name)
        before = open(path, "rb").read() if os.path.isfile(path) else None
        if before == data:
            continue
        write_checkpoint_file(path, lambda f, data=data: f.write(data))
        undo.append((path, before))

    def put_back() -> None:
        for path, before in reversed(undo):
            if before is None:
                os.unlink(path)
            else:
                write_checkpoint_file(path, lambda f, before=before: f.write(before))
    return put_back


def publish_latest(directory: str, iteration: int, beside: dict[str, bytes] | None = None
                   ) -> None:
    """Point `latest` at `iteration` with `beside` (`write_beside`) written first: both or
    neither (a failed `latest` puts the files beside it back)."""
    undo = write_beside(directory, beside or {})
    try:
        write_latest(directory, iteration)
    except BaseException:
        try:
            undo()
        except (CheckpointError, OSError):
            pass  # the error that stopped the save is the one to report
        raise


def not_newer(directory: str, iteration: int, current: int) -> str:
    return (f"refusing to save iteration {iteration} into {directory}: it already holds the newer "
            f"iteration {current} (latest); resume from it with --load {directory}, or save "
            "this run elsewhere")


def iterations(directory: str) -> list[int]:
    return sorted(int(m.group(1)) for d in os.listdir(directory)
                  if (m := re.fullmatch(r"iter_(\d{7})", d)))


def prune(save_dir: str, keep_last: int) -> None:
    """Delete all but the `keep_last` newest iteration directories (never the latest)."""
    latest = latest_iteration(save_dir)
    for it in iterations(save_dir)[:-keep_last] if keep_last > 0 else []:
        if it != latest:
            shutil.rmtree(iteration_dir(save_dir, it), ignore_errors=True)


def temporary_files(directory: str) -> list[str]:
    """Leftover `.tmp-` files and torch_dist save directories of interrupted writes in a
    checkpoint tree (only where this package writes: the top level and the iter_*/mp_rank_*
    directories)."""
    return sorted(glob.glob(os.path.join(directory, TMP_PREFIX + "*")) +
                  glob.glob(os.path.join(directory, "iter_*", "mp_rank_*", TMP_PREFIX + "*")))


def remove_temporary_files(directory: str) -> list[str]:
    """Delete the leftovers of writes that a killed process never finished; returns them.
    Call it only when no process of this job writes into `directory`."""
    removed = []
    for path in temporary_files(directory):
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed
