"""The NVMe tier's data file: preallocated, page-addressed, O_DIRECT where the file system allows.

Pages have the arena's size (a multiple of 4096), and every transfer moves whole pages between the
file and the (page-aligned) arena, so O_DIRECT's alignment rules hold by construction and the page
cache is bypassed. O_DIRECT is probed at start on a scratch file: where the file system refuses it
(tmpfs, some overlay setups) the tier falls back to buffered I/O plus ``fdatasync`` and says so in a
warning and in the ``kvtierd_nvme_direct_io`` metric.

``IoQueue`` keeps up to ``depth`` reads or writes in flight on the file: one job's transfers (a
write job's chunks, a large chunk's pieces) run at once instead of one after another, because a
job runs on one I/O thread and spends its time waiting for the device, not the CPU.

``FaultInjector`` wraps a DataFile for tests: it reads a small JSON file before each operation and
raises the errno it names (ENOSPC, EIO, ENOENT), so a test can break the disk of a running daemon.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Sequence

log = logging.getLogger(__name__)

DATA_NAME = "chunks.data"
LOCK_NAME = "kvtierd.lock"


class DirectoryInUse(RuntimeError):
    pass


OWNER_NAME = "instance"


def make_state_dir(directory: Path, mode: int) -> None:
    """Create ``directory`` (and missing parents) with ``mode`` and narrow it to ``mode`` if it
    exists with more: it holds chunk data and an index of tenants, namespaces and prefix hashes."""
    directory.mkdir(mode=mode, parents=True, exist_ok=True)
    current = directory.stat().st_mode & 0o777
    if current != mode:
        log.warning("state directory %s had mode %o; set to %o", directory, current, mode)
        directory.chmod(mode)


def lock_directory(directory: Path) -> int:
    """Hold an exclusive lock on ``directory`` so two daemons never share one NVMe tier."""
    fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    os.fchmod(fd, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DirectoryInUse(f"{directory} is in use by another kvtierd (flock on {LOCK_NAME})")
    return fd


def claim_directory(directory: Path, instance: str) -> None:
    """Record which daemon instance the tier in ``directory`` belongs to; refuse another's.

    The lock only keeps out a *live* second daemon. A different daemon started on the same
    directory later (another socket, another page size) would otherwise reset the index and drop
    the first one's chunks; it is refused instead, naming both instances."""
    path = directory / OWNER_NAME
    try:
        owner = path.read_text().strip()
    except FileNotFoundError:
        owner = ""
    if owner and owner != instance:
        raise DirectoryInUse(
            f"nvme_dir {directory} holds the NVMe tier of kvtierd instance {owner!r}; this daemon "
            f"is instance {instance!r}. Give it its own nvme_dir, or set instance = {owner!r} if "
            "it is meant to take that tier over")
    if owner != instance:
        tmp = directory / f".{OWNER_NAME}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # like every file of the tier: the daemon's alone
            os.write(fd, (instance + "\n").encode())
        finally:
            os.close(fd)
        os.replace(tmp, path)
    elif path.stat().st_mode & 0o077:
        path.chmod(0o600)


def probe_direct_io(directory: Path, page_bytes: int) -> bool:
    """Whether O_DIRECT aligned writes and reads work in ``directory``."""
    path = directory / ".direct-io-probe"
    buf = mmap.mmap(-1, page_bytes)
    buf.write(os.urandom(page_bytes))
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        os.pwritev(fd, [buf], 0)
        back = mmap.mmap(-1, page_bytes)
        os.preadv(fd, [back], 0)
        return back[:] == buf[:]
    except OSError:
        return False
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


class DataFile:
    """``num_pages`` pages of ``page_bytes`` in one preallocated file."""

    def __init__(self, directory: Path, nbytes: int, page_bytes: int, direct: bool) -> None:
        self.path = directory / DATA_NAME
        self.page_bytes = page_bytes
        self.num_pages = nbytes // page_bytes
        self.direct = direct
        # Group commit: sync() callers take tickets; one fdatasync covers every ticket taken
        # before it started (their writes had finished by then).
        self._tickets = 0
        self._covered = 0
        self._ticket_lock = threading.Lock()
        self._sync_lock = threading.Lock()
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | (os.O_DIRECT if direct else 0)
        self.fd = os.open(self.path, flags, 0o600)
        os.fchmod(self.fd, 0o600)  # the chunks' bytes: the daemon's alone (an older file narrowed)
        size = self.num_pages * page_bytes
        if os.fstat(self.fd).st_size != size:
            os.ftruncate(self.fd, size)
        try:
            os.posix_fallocate(self.fd, 0, size)  # reserve the blocks now: ENOSPC at start, not later
        except OSError as exc:
            if exc.errno != errno.EOPNOTSUPP and exc.errno != errno.EINVAL:
                os.close(self.fd)
                raise

    def write(self, page: int, views: list[memoryview]) -> None:
        """Write ``views`` (whole pages, page-aligned memory) starting at ``page``."""
        expected = sum(len(v) for v in views)
        done = os.pwritev(self.fd, views, page * self.page_bytes)
        if done != expected:
            raise OSError(errno.EIO, f"short write: {done} of {expected} bytes at page {page}")

    def read(self, page: int, views: list[memoryview]) -> None:
        expected = sum(len(v) for v in views)
        done = os.preadv(self.fd, views, page * self.page_bytes)
        if done != expected:
            raise OSError(errno.EIO, f"short read: {done} of {expected} bytes at page {page}")

    def sync(self) -> None:
        """Make every write that finished before this call durable.

        Jobs finishing together would each flush the device (serialised by the kernel: a
        virtual disk took up to 28 ms per flush with four at once); instead one fdatasync at a
        time runs, and a caller whose writes an fdatasync started after them already covered
        returns without another. A failed fdatasync covers nobody: its caller raises, the next
        one tries again."""
        with self._ticket_lock:
            self._tickets += 1
            ticket = self._tickets
        with self._sync_lock:
            if self._covered >= ticket:
                return
            with self._ticket_lock:
                covers = self._tickets
            os.fdatasync(self.fd)
            self._covered = covers

    def close(self) -> None:
        os.close(self.fd)


class IoQueue:
    """At most ``depth`` transfers in flight on the data file, shared by every I/O job of the tier.

    Threads rather than io_uring: ``os.preadv``/``os.pwritev`` release the GIL, so ``depth``
    threads keep ``depth`` requests at the device, which is what fio's ``numjobs`` does. Every
    transfer goes through the pool (the job's own thread only waits), so the bound holds however
    many jobs run at once; the hand-off costs microseconds against milliseconds of I/O.
    """

    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"io queue depth must be >= 1, not {depth}")
        self.depth = depth
        self._pool = ThreadPoolExecutor(max_workers=depth, thread_name_prefix="kvtierd-io")

    def run(self, calls: Sequence[Callable[[], None]]) -> None:
        """Run every call and wait for all of them, then raise the first error: no transfer is
        still touching the job's buffers when the job fails or finishes."""
        futures = [self._pool.submit(call) for call in calls]
        del calls
        errors = [f.exception() for f in futures]
        del futures
        first = next((e for e in errors if e is not None), None)
        del errors
        if first is None:
            return
        try:
            raise first
        finally:
            # This frame would otherwise be a cycle with the error's traceback and keep its
            # arena views alive until a GC pass: the arena could not be closed at shutdown.
            del first

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class FaultInjector:
    """Test-only wrapper: before each op, raise the errno named in ``fault_file`` for that op.

    ``fault_file`` holds JSON such as ``{"write": "ENOSPC", "read": "EIO", "sync": "EIO"}``;
    a missing file or op means no fault.
    """

    def __init__(self, inner: DataFile, fault_file: Path) -> None:
        self.inner = inner
        self.fault_file = fault_file
        self.path, self.page_bytes, self.num_pages = inner.path, inner.page_bytes, inner.num_pages
        self.direct = inner.direct

    def _maybe_fail(self, op: str) -> None:
        try:
            faults = json.loads(self.fault_file.read_text())
        except (FileNotFoundError, ValueError):
            return
        name = faults.get(op)
        if name:
            code = getattr(errno, name)
            raise OSError(code, f"injected {name} on {op}: {os.strerror(code)}")

    def write(self, page: int, views: list[memoryview]) -> None:
        self._maybe_fail("write")
        self.inner.write(page, views)

    def read(self, page: int, views: list[memoryview]) -> None:
        self._maybe_fail("read")
        self.inner.read(page, views)

    def sync(self) -> None:
        self._maybe_fail("sync")
        self.inner.sync()

    def close(self) -> None:
        self.inner.close()
