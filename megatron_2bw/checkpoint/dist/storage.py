"""torch.distributed.checkpoint (DCP) pieces for the torch_dist format: planners over shard lists
(shards.py), a writer that hashes every file while writing it, and a reader that checks the
hashes of the files it reads.

The files are DCP's own (`__<rank>_0.distcp` with each rank's boxes, `.metadata` with every
tensor's global shape, its chunks and where they are), so DCP's tools read them
(`torch.distributed.checkpoint.format_utils.dcp_to_torch_save` gives the full tensors). The
planners only replace DCP's state-dict walk: a rank hands a list of boxes of global tensors
instead of DTensors, so the flat buffers of the pipeline engine need no device mesh.

    plan_save(shards, objects, directory, comm)    collective: DCP's global plan (dedup of
                                                   replicated boxes, metadata, validation)
    write_files(save)                              this rank's files, sha256 while writing,
                                                   fsynced (runs on a background thread too)
    finish_metadata(save, results)                 rank 0: `.metadata` (and its sha256)
    read_boxes(directory, targets, objects, sums)  this rank's boxes of any layout, per rank,
                                                   no collective (each file checked first)
    plan_read(...) / read.files / run_read(read)   the same in steps, for a job that has its
                                                   files checked once (files.verify_once)
"""
from __future__ import annotations

import io
import os
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import (LoadItemType, LoadPlan, LoadPlanner, ReadItem,
                                                  SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)

from megatron_2bw.checkpoint.dist.shards import Shard
from megatron_2bw.checkpoint.files import CheckpointError, file_digest
from megatron_2bw.fs import HashingWriter

METADATA = ".metadata"
CHECKSUMS = "checksums.sha256"


class _HashingStream(HashingWriter):
    """fs.HashingWriter that reports its digest when closed."""

    def __init__(self, f, on_close):
        super().__init__(f)
        self.on_close = on_close

    def close(self) -> None:
        if not self.f.closed:
            self.f.close()
            self.on_close(self)


class _HashingFileSystem(FileSystem):
    """DCP's file system; every file written is hashed on the way (`digests`: name -> sha256,
    `written`: name -> bytes so far, for error messages)."""

    def __init__(self):
        self.digests: dict[str, str] = {}
        self.written: dict[str, int] = {}
        self.error: tuple[str, OSError] | None = None  # (file, the OS error a write raised)

    @contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        name = os.path.basename(str(path))
        stream = _HashingStream(open(path, mode), lambda s: self.digests.__setitem__(
            name, s.sha.hexdigest()))
        self.written[name] = 0
        try:
            yield stream
        finally:
            self.written[name] = stream.written
            if stream.error is not None:
                self.error = (name, stream.error)
            stream.close()


class _Writer(FileSystemWriter):
    def __init__(self, directory: str):
        super().__init__(directory, single_file_per_rank=True, sync_files=True, thread_count=1,
                         overwrite=False)
        self.fs = _HashingFileSystem()


class ShardSavePlanner(DefaultSavePlanner):
    """DCP's default save planning (dedup, metadata, validation) over a list of Shards and
    picklable objects instead of a state dict."""

    def __init__(self, shards: list[Shard], objects: dict):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.tensors = {}
        for s in shards:  # a box held twice by one rank (tied copies of a converted file) once
            self.tensors.setdefault((s.name, tuple(s.offsets)), s)
        self.objects = objects

    def set_up_planner(self, state_dict=None, storage_meta=None, is_coordinator=False) -> None:
        self.state_dict, self.is_coordinator = {}, is_coordinator

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=MetadataIndex(s.name, s.offsets), type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(
                               chunk=ChunkStorageMetadata(offsets=torch.Size(s.offsets),
                                                          sizes=s.tensor.size()),
                               properties=TensorProperties.create_from_tensor(s.tensor),
                               size=torch.Size(s.global_shape)))
                 for s in self.tensors.values()]
        items += [WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO)
                  for key in self.objects]
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        index = write_item.index
        if write_item.type == WriteItemType.BYTE_IO:
            buf = io.BytesIO()
            torch.save(self.objects[index.fqn], buf)
            return buf
        return self.tensors[(index.fqn, tuple(index.offset))].tensor


@dataclass
class PlannedSave:
    """One rank's part of a save: where, what, and (rank 0) the checkpoint's metadata."""
    directory: str
    writer: _Writer
    planner: ShardSavePlanner
    plan: SavePlan
    metadata: Metadata | None
    digests: dict = field(default_factory=dict)

    def first_file(self) -> str:
        return os.path.join(self.directory, f"{self.plan.storage_data.prefix}0.distcp")


def plan_save(shards: list[Shard], objects: dict, directory: str, comm) -> PlannedSave:
    """Collective (one gather of the local plans through `comm`): every rank computes DCP's
    global plan from all local plans (deterministic, so no scatter) and keeps its own part."""
    rank = comm.rank
    writer, planner = _Writer(directory), ShardSavePlanner(shards, objects)
    planner.set_up_planner(storage_meta=writer.storage_meta(), is_coordinator=rank == 0)
    writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
    local = writer.prepare_local_plan(planner.create_local_plan())
    plans, metadata = planner.create_global_plan(comm.gather_objects(local))
    plans = writer.prepare_global_plan(plans)
    return PlannedSave(directory, writer, planner, planner.finish_plan(plans[rank]),
                       metadata if rank == 0 else None)


def write_files(save: PlannedSave) -> list:
    """Write this rank's files (fsynced, directory entry too); returns DCP's write results and
    leaves each file's sha256 in `save.digests`. An OS error is one CheckpointError naming the
    file, the bytes written and the fix."""
    from megatron_2bw.fs import fsync_directory
    from megatron_2bw.checkpoint.files import write_error
    fs = save.writer.fs
    try:
        results = save.writer.write_data(save.plan, save.planner).value()
        fsync_directory(save.directory)
    except Exception as e:  # noqa: BLE001 - name the OS error whatever wrapped it
        if fs.error is None and not isinstance(e, OSError):
            raise
        name, error = fs.error or (os.path.basename(save.first_file()), e)
        raise CheckpointError(write_error(os.path.join(save.directory, name), error,
                                          fs.written.get(name, 0))) from None
    save.digests = dict(fs.digests)
    return results


def finish_metadata(save: PlannedSave, results: list[list]) -> dict[str, str]:
    """Rank 0: write DCP's `.metadata` from every rank's write results (fsynced, renamed into
    place); returns its sha256 by name, computed while writing."""
    save.writer.finish(metadata=save.metadata, results=results)
    digests = save.writer.fs.digests
    return {METADATA: digests[METADATA + ".tmp"]}


# -- reading ---------------------------------------------------------------------------------------
def read_checksums(directory: str) -> dict[str, str]:
    """file name -> sha256 from the directory's checksum list; one-line error if it is missing
    (the save never finished)."""
    path = os.path.join(directory, CHECKSUMS)
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {directory} has no {CHECKSUMS}: the save did not "
                              "finish; load an earlier iteration")
    sums = {}
    for line in open(path).read().splitlines():
        digest, _, name = line.partition("  ")
        sums[name] = digest
    return sums


def file_problem(directory: str, name: str, sums: dict[str, str]) -> str | None:
    """Why the checkpoint file `name` cannot be used (missing, or not matching its sha256 in
    the checksum list), else None; hashed at most once per process (files.file_digest)."""
    path = os.path.join(directory, name)
    if not os.path.exists(path):
        return (f"checkpoint file {path} is missing: the checkpoint is incomplete; load an "
                "earlier iteration")
    if name not in sums or file_digest(path) != sums[name]:
        return (f"checkpoint file {path} does not match its checksum in {CHECKSUMS}: it is "
                "truncated or corrupted; load an earlier iteration")
    return None


def verify_file(directory: str, name: str, sums: dict[str, str]) -> None:
    problem = file_problem(directory, name, sums)
    if problem:
        raise CheckpointError(problem)


def read_metadata(directory: str, sums: dict[str, str] | None = None,
                  verify: bool = True) -> Metadata:
    """DCP's `.metadata`, checked first unless `verify` is False (checked already)."""
    if verify:
        verify_file(directory, METADATA, read_checksums(directory) if sums is None else sums)
    try:
        return FileSystemReader(directory).read_metadata()
    except Exception as e:  # noqa: BLE001 - unpickling a damaged file fails in many ways
        raise CheckpointError(f"cannot read checkpoint file {os.path.join(directory, METADATA)} "
                              f"({type(e).__name__}): load an earlier iteration") from None


def _reads(name: str, saved: list, want: ChunkStorageMetadata, index: int) -> list[ReadItem]:
    """The reads that fill box `want` (target `index`) from the saved chunks it overlaps: what
    torch's planner_helpers.create_read_items_for_chunk_list does, with public types only."""
    items = []
    for k, c in enumerate(saved):
        lo = [max(a, b) for a, b in zip(want.offsets, c.offsets)]
        hi = [min(a + m, b + n) for a, m, b, n in zip(want.offsets, want.sizes, c.offsets, c.sizes)]
        if any(h <= ell for ell, h in zip(lo, hi)):
            continue  # no overlap (a 0-d tensor has no dimension: it always overlaps)
        items.append(ReadItem(
            type=LoadItemType.TENSOR, dest_index=MetadataIndex(name, want.offsets, index),
            dest_offsets=torch.Size(x - o for x, o in zip(lo, want.offsets)),
            storage_index=MetadataIndex(name, c.offsets, k),
            storage_offsets=torch.Size(x - o for x, o in zip(lo, c.offsets)),
            lengths=torch.Size(h - x for x, h in zip(lo, hi))))
    return items


class ShardLoadPlanner(LoadPlanner):
    """Reads a list of target Shards (views to fill) and named objects from a checkpoint of any
    layout: DCP's resharding reads per box (`_reads`)."""

    def __init__(self, targets: list[Shard], objects: list[str], unpickle=None):
        self.targets = list(targets)  # boxes may overlap (a master piece and the newest)
        self.wanted, self.objects = list(objects), {}
        self.unpickle = unpickle or (lambda f: torch.load(f, weights_only=True))

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        md, items = self.metadata.state_dict_metadata, []
        for i, s in enumerate(self.targets):
            saved = md.get(s.name)
            if saved is None:
                raise CheckpointError(f"lacks the tensor {s.name}")
            if tuple(saved.size) != tuple(s.global_shape):
                raise CheckpointError(f"holds {s.name} with shape {tuple(saved.size)}, this "
                                      f"model needs {tuple(s.global_shape)}")
            chunk = ChunkStorageMetadata(offsets=torch.Size(s.offsets), sizes=s.tensor.size())
            items += _reads(s.name, saved.chunks, chunk, i)
        for key in self.wanted:
            if key not in md:
                raise CheckpointError(f"lacks {key}")
            items.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=MetadataIndex(key),
                                  dest_offsets=torch.Size((0,)), storage_index=MetadataIndex(key),
                                  storage_offsets=torch.Size((0,)), lengths=torch.Size((0,))))
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.objects[read_item.dest_index.fqn] = self.unpickle(value)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        index = read_item.dest_index
        view = self.targets[index.index].tensor
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            view = view.narrow(dim, start, length)
        return view

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


@dataclass
class PlannedRead:
    """One rank's read of a checkpoint: DCP's reader, the planner and the plan; `files` are the
    names of the files it reads."""
    directory: str
    reader: FileSystemReader
    planner: ShardLoadPlanner
    plan: LoadPlan
    files: list[str]


def plan_read(directory: str, targets: list[Shard], objects: list[str],
              metadata: Metadata, unpickle=None) -> PlannedRead:
    """Plan filling `targets` (views) and reading the named `objects` (`unpickle(file)`: how;
    default torch.load's weights_only); a missing tensor or one of another shape is one
    CheckpointError naming the directory. Reads no data file."""
    reader = FileSystemReader(directory)
    planner = ShardLoadPlanner(targets, objects, unpickle)
    reader.set_up_storage_reader(metadata, True)
    planner.set_up_planner({}, metadata, True)
    try:
        plan = planner.finish_plan(reader.prepare_local_plan(planner.create_local_plan()))
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint {directory} {e}: it was saved for another model "
                              "(use matching flags)") from None
    files = sorted({reader.storage_data[r.storage_index].relative_path for r in plan.items})
    return PlannedRead(directory, reader, planner, plan, files)


def run_read(read: PlannedRead) -> dict:
    """Read the planned boxes (their files must have been checked); returns the objects."""
    try:
        read.reader.read_data(read.plan, read.planner).wait()
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - unpickling a damaged file fails in many ways
        raise CheckpointError(f"cannot read checkpoint {read.directory} ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}): load an earlier "
                              "iteration") from None
    return read.planner.objects


def read_boxes(directory: str, targets: list[Shard], objects: list[str],
               sums: dict[str, str] | None = None, metadata: Metadata | None = None) -> dict:
    """Fill `targets` (views) from the checkpoint in `directory` and return the named `objects`;
    this rank alone (no collective), each file checked against the checksum list before it is
    read. CheckpointError (one line, naming the directory) on a missing or damaged file, a
    missing tensor or a shape that differs."""
    sums = read_checksums(directory) if sums is None else sums
    metadata = read_metadata(directory, sums) if metadata is None else metadata
    read = plan_read(directory, targets, objects, metadata)
    for name in read.files:
        verify_file(directory, name, sums)
    return run_read(read)
