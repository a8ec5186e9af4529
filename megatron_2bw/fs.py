"""The one owner of how the product writes files: atomically, under unique temporary names, into
directories it has checked, and where its caches live. Every write of the package goes through
here or through the checkpoint storage layer (checkpoint/dist/storage.py, DCP's writer);
tests/unit/test_writes.py finds any other `torch.save` or `open(..., "w")`.

    AtomicFile(path)               a file object streaming into a temporary sibling: commit()
                                   fsyncs and renames it over `path`, discard() drops it; as a
                                   context manager it commits on success, discards on error
    atomic_write(path, write)      write(file) into an AtomicFile and commit it; returns the
                                   sha256 of the bytes
    atomic_write_bytes(path, b)    the same for bytes; atomic_write_text(path, s) for text,
                                   atomic_save_npy(path, array) for numpy
    atomic_create(path, write)     create-if-absent: write(file) into a temporary sibling and
                                   hard-link it to `path` only if `path` does not exist yet (it
                                   never replaces a file another process may have open); True
                                   when ours was published (atomic_create_bytes, _npy alike)
    publish_new(tmp, path)         the link-if-absent step on a finished temporary
    atomic_build_dir(final, build) build a whole directory under a temporary name, then rename
    unique_temp(path)              `.tmp-NAME-HOST-PID-RANDOM` next to `path`: unique across
                                   the hosts of a shared filesystem, so no locks are needed
    fsync_directory(dir)           make renames and new entries in `dir` durable
    writable_problem(dir)          why `dir` cannot be created and written (None when it can)
    user_cache_dir()               $MEGATRON_2BW_CACHE, else ~/.cache/megatron_2bw

A reader sees the old file or the new one, never half of one; a writer killed mid-write leaves
only a `.tmp-` name (TMP_PREFIX), which the checkpoint start-up removes. A failed write is a
`WriteError` (an OSError) that keeps the OS error and the bytes written; its message is one line
naming the file, the error and the fix (`write_problem`).
Must not import: anything of the package (it is the bottom layer).
"""
from __future__ import annotations

import errno
import hashlib
import os
import shutil
import socket
import uuid
from pathlib import Path
from typing import Callable

TMP_PREFIX = ".tmp-"


class WriteError(OSError):
    """A write that failed: `cause` (the OSError: ENOSPC, EDQUOT, EACCES ...) after `written`
    bytes of `path`."""

    def __init__(self, path: str, cause: OSError, written: int):
        super().__init__(cause.errno, cause.strerror or str(cause))
        self.path, self.cause, self.written = path, cause, written

    def __str__(self) -> str:
        return write_problem(f"file {self.path}", self.cause, self.written)


_FIXES = {errno.ENOSPC: "free space on that file system or point {where} elsewhere",
          errno.EDQUOT: "free space within your quota or point {where} elsewhere",
          errno.EACCES: "make the directory writable or point {where} elsewhere",
          errno.EROFS: "point {where} at a writable file system"}


def write_problem(what: str, cause: OSError, written: int, where: str = "the output") -> str:
    """'cannot write WHAT: No space left on device (ENOSPC) after N bytes: FIX' (`where` is the
    option or thing the fix tells the user to point elsewhere)."""
    name = errno.errorcode.get(cause.errno, "error") if cause.errno else type(cause).__name__
    fix = _FIXES.get(cause.errno, "check the disk").format(where=where)
    return f"cannot write {what}: {cause.strerror or cause} ({name}) after {written} bytes: {fix}"


def user_cache_dir() -> Path:
    """$MEGATRON_2BW_CACHE, else ~/.cache/megatron_2bw."""
    root = os.environ.get("MEGATRON_2BW_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "megatron_2bw"


def unique_temp(path) -> Path:
    """A sibling of `path` no other process (on any host) uses: `.tmp-NAME-HOST-PID-RANDOM`."""
    path = Path(path)
    return path.with_name(f"{TMP_PREFIX}{path.name}-{socket.gethostname()}-{os.getpid()}-"
                          f"{uuid.uuid4().hex[:8]}")


def fsync_directory(directory) -> None:
    """Make the directory's entries (files created or renamed in it) durable."""
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


class HashingWriter:
    """A file object that counts and hashes the bytes written (the checksum needs no re-read) and
    keeps the OSError a write raised (torch's zip writer swallows it and raises 'unexpected pos'
    instead)."""

    def __init__(self, f):
        self.f, self.written, self.error = f, 0, None
        self.sha = hashlib.sha256()

    def write(self, data) -> int:
        try:
            n = self.f.write(data)
        except OSError as e:
            self.error = e
            raise
        self.sha.update(data)
        self.written += n
        return n

    def flush(self) -> None:
        self.f.flush()

    def tell(self) -> int:
        return self.f.tell()

    def fileno(self) -> int:
        return self.f.fileno()


class AtomicFile(HashingWriter):
    """A binary file object writing into a unique temporary sibling of `path` (counting and
    hashing the bytes). commit() flushes, fsyncs and renames it over `path`, then fsyncs the
    directory, and returns the sha256; discard() closes and deletes it (idempotent). close()
    makes the temporary durable without publishing it (commit later, e.g. after its partner
    files). As a context manager: commit on success, discard on any exception. Every OS error
    is one WriteError; after one before the rename, `path` is as it was and the temporary is
    gone."""

    def __init__(self, path):
        self.path, self.tmp = str(path), None
        self.directory = os.path.dirname(self.path) or "."
        try:
            os.makedirs(self.directory, exist_ok=True)
            tmp = str(unique_temp(self.path))
            super().__init__(open(tmp, "xb"))
        except OSError as e:
            raise WriteError(self.path, e, 0) from None
        self.tmp = tmp

    def write(self, data) -> int:
        try:
            return super().write(data)
        except OSError as e:
            raise self.failed(e) from None

    def failed(self, e: BaseException) -> BaseException:
        """The exception to raise for `e` raised while writing: a WriteError for an OS error
        (the one a write raised, even when a caller such as torch's zip writer replaced it),
        `e` itself otherwise."""
        cause = self.error or e
        if isinstance(cause, WriteError) or not isinstance(cause, OSError):
            return cause
        return WriteError(self.path, cause, self.written)

    def close(self) -> str:
        if not self.f.closed:
            try:
                try:
                    self.f.flush()
                    os.fsync(self.f.fileno())
                finally:
                    self.f.close()
            except OSError as e:
                self.discard()
                raise self.failed(e) from None
        return self.sha.hexdigest()

    def commit(self) -> str:
        digest = self.close()
        try:
            os.replace(self.tmp, self.path)
            self.tmp = None
            fsync_directory(self.directory)
        except OSError as e:
            self.discard()
            raise self.failed(e) from None
        return digest

    def discard(self) -> None:
        try:
            self.f.close()
        except OSError:
            pass  # the data is being dropped: a failed final flush changes nothing
        if self.tmp is not None and os.path.exists(self.tmp):
            os.unlink(self.tmp)
        self.tmp = None

    def __enter__(self) -> "AtomicFile":
        return self

    def __exit__(self, kind, e, tb) -> None:
        if kind is None:
            self.commit()
            return
        self.discard()
        failure = self.failed(e)
        if failure is not e:
            raise failure from None


def atomic_write(path, write: Callable) -> str:
    """write(file_object) into an AtomicFile of `path` and commit it: `path` then holds all of
    it or (on any error, one WriteError for an OS error) is left as it was. Returns the sha256
    of what was written."""
    with AtomicFile(path) as f:
        write(f)
    return f.sha.hexdigest()


def atomic_write_bytes(path, data: bytes) -> str:
    return atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path, text: str) -> str:
    return atomic_write_bytes(path, text.encode())


def atomic_save_npy(path, array) -> None:
    import numpy as np
    atomic_write(path, lambda f: np.save(f, array, allow_pickle=False))


_NO_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS, errno.EMLINK,
             errno.EXDEV}  # hard links not supported here (some FUSE / object-store mounts)


def publish_new(tmp, final) -> bool:
    """Give the finished, fsynced temporary `tmp` the name `final` only if no file has it yet
    (create-if-absent): a hard link, which fails with EEXIST instead of replacing a file that
    another process, on any node, may already have open (a rename over it would; on NFS its
    reader then gets ESTALE). True when ours is published; False when another writer's file was
    there first (theirs is kept, ours dropped). `tmp` is gone afterwards either way. Where hard
    links are not supported, a rename when `final` is absent (the window left is between that
    check and the rename)."""
    tmp, final = str(tmp), str(final)
    try:
        try:
            os.link(tmp, final)
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno not in _NO_LINKS:
                raise
            if os.path.lexists(final):
                return False
            os.rename(tmp, final)
        fsync_directory(os.path.dirname(final) or ".")
        return True
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def atomic_create(path, write: Callable) -> bool:
    """write(file_object) into an AtomicFile of `path`, made durable and published with
    `publish_new` (never over an existing `path`): True when ours is the file at `path` now,
    False when another writer's was there first. On any error (one WriteError for an OS error)
    nothing is published and the temporary is gone."""
    f = AtomicFile(path)
    try:
        write(f)
        f.close()
    except BaseException as e:
        f.discard()
        failure = f.failed(e)
        if failure is e:
            raise
        raise failure from None
    tmp, f.tmp = f.tmp, None
    try:
        return publish_new(tmp, path)
    except OSError as e:
        raise WriteError(str(path), e, f.written) from None


def atomic_create_bytes(path, data: bytes) -> bool:
    return atomic_create(path, lambda f: f.write(data))


def atomic_create_npy(path, array) -> bool:
    import numpy as np
    return atomic_create(path, lambda f: np.save(f, array, allow_pickle=False))


def atomic_build_dir(final: Path, build: Callable[[Path], None]) -> bool:
    """Build a directory with build(tmp_dir) and rename it to `final`. Returns False when another
    builder's directory got there first (ours is discarded; theirs is complete)."""
    tmp = unique_temp(final)
    tmp.mkdir(parents=True)
    try:
        build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if final.is_dir():
                return False
            raise
        fsync_directory(final.parent)
        return True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def writable_problem(path) -> str | None:
    """Create `path` if needed; what is wrong ("is a file, not a directory", "cannot be created
    (Permission denied)", "is not writable") when it cannot be written, else None."""
    path = str(path)
    if os.path.exists(path) and not os.path.isdir(path):
        return "is a file, not a directory"
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        return f"cannot be created ({e.strerror})"
    if not os.access(path, os.W_OK | os.X_OK):
        return "is not writable"
    return None
