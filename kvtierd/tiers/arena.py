"""The pinned-CPU tier's memory: one named shared-memory region, mapped once.

The region is a file under /dev/shm so that it has a name (an operator can see it, a later warm
restart can re-attach to it). Fresh shm pages cost a page fault on first touch (~1 GB/s here), so the
arena is populated at start (``MAP_POPULATE``) and, where RLIMIT_MEMLOCK allows, locked so that it is
never swapped. CUDA registration of the same memory is the GPU path's job.

Lifecycle: the arena file is ``flock``ed for the daemon's life, so "no process holds its lock"
means "its daemon is dead", whatever killed it (kill -9, the OOM killer, a container restart where
every daemon is PID 1). ``reclaim_stale_arenas`` frees such files at start; a persistent arena (one
with a ``<name>.index`` beside it) is kept for the warm restart that re-attaches it. The file's
blocks are allocated at start (``posix_fallocate``): a /dev/shm too small is ENOSPC then, never a
SIGBUS on some later first touch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import logging
import mmap
import os
import resource
import stat
import time
from pathlib import Path

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
ARENA_PREFIX = "kvtierd-"
# A persistent arena's SQLite index and its WAL/journal files: never arenas themselves.
# Its snapshot (``index_snapshot.path_for``) ends in ".index" too, so older daemons keep it.
INDEX_SUFFIXES = (".index", ".index-wal", ".index-shm", ".index-journal", ".snapshot.index",
                  ".snapshot-tmp.index")
LOCK_WAIT_S = 1.0  # a reclaiming daemon holds a stale arena's lock for a moment only
CAP_IPC_LOCK = 14


class ArenaError(RuntimeError):
    """The arena cannot be created or locked; the message says why and what to do."""


def is_arena_name(name: str) -> bool:
    return name.startswith(ARENA_PREFIX) and not name.endswith(INDEX_SUFFIXES)


def index_files(shm_dir: Path, name: str) -> list[Path]:
    return [shm_dir / f"{name}{suffix}" for suffix in INDEX_SUFFIXES]


def reclaim_stale_arenas(shm_dir: Path = SHM_DIR, keep: str = "") -> list[tuple[str, int]]:
    """Remove every ``kvtierd-*`` arena in ``shm_dir`` whose lock no process holds (its daemon
    died), except persistent ones (with an index file) and ``keep`` (the caller's own name, which
    it re-creates or re-attaches itself). A locked arena is never touched. Returns (name, bytes
    freed) per removed file."""
    freed: list[tuple[str, int]] = []
    try:
        entries = sorted(os.scandir(shm_dir), key=lambda e: e.name)
    except OSError as exc:
        log.warning("cannot list %s to reclaim stale arenas: %s", shm_dir, exc)
        return freed
    for entry in entries:
        if entry.name == keep or not is_arena_name(entry.name):
            continue
        nbytes = _reclaim_one(shm_dir, entry.name)
        if nbytes is not None:
            freed.append((entry.name, nbytes))
    if freed:
        log.warning("reclaimed %d stale arena(s) of dead daemons, %d bytes freed: %s", len(freed),
                    sum(n for _, n in freed), ", ".join(name for name, _ in freed))
    return freed


def _reclaim_one(shm_dir: Path, name: str) -> int | None:
    path = shm_dir / name
    try:  # not ours to open (another user's, a socket, a symlink): not ours to remove
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None  # a live daemon's
        if (shm_dir / f"{name}.index").exists():
            log.info("kept the persistent arena %s of a stopped daemon (%d bytes) for its warm "
                     "restart", path, st.st_blocks * 512)
            return None
        try:
            if os.stat(path, follow_symlinks=False).st_ino != st.st_ino:
                return None  # replaced since we opened it: a new daemon's
            path.unlink()
        except FileNotFoundError:
            return None
        return st.st_blocks * 512
    finally:
        os.close(fd)


def _open_locked(path: Path) -> int:
    """Open (creating) and flock the arena file; retried while a reclaiming daemon holds a stale
    file's lock or removes it between our open and our lock."""
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            try:
                if os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                    return fd
            except FileNotFoundError:
                pass
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise ArenaError(f"arena {path} is in use by another kvtierd (it holds the "
                                 "arena's lock): give this daemon its own socket or instance "
                                 "name") from None
            time.sleep(0.02)
        os.close(fd)


def _allocate(fd: int, path: Path, nbytes: int) -> None:
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise
        free = os.statvfs(path.parent)
        raise ArenaError(
            f"cannot allocate the {nbytes}-byte arena {path}: {exc.strerror} ({path.parent} has "
            f"{free.f_bavail * free.f_frsize} bytes free); lower cpu_bytes or give {path.parent} "
            "more space") from None
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.munlock.argtypes = (ctypes.c_void_p, ctypes.c_size_t)


class Arena:
    """A mapped shared-memory region of ``nbytes`` bytes with a stable base address."""

    def __init__(self, name: str, nbytes: int, *, prefault: bool = True, lock: bool = True,
                 persistent: bool = False):
        """A private arena must not exist yet; a ``persistent`` one is re-attached when a file of
        the same size is there (``self.attached``), else created fresh."""
        self.name = name
        self.nbytes = nbytes
        self.path = SHM_DIR / name
        self.locked = False
        self.attached = False
        fd = _open_locked(self.path)  # one daemon per arena, for its whole life
        try:
            os.fchmod(fd, 0o600)  # every tenant's KV bytes: the daemon's alone (older files too)
            self._reset_stale(fd, persistent)
            info = os.fstat(fd)
            self.attached = persistent and info.st_size == nbytes
            # A re-attached arena whose every block is allocated already (the earlier start's
            # fallocate) skips it: fallocate walks every page of the file (0.3 s per 5 GB).
            if not (self.attached and info.st_blocks * 512 >= nbytes):
                _allocate(fd, self.path, nbytes)
            os.ftruncate(fd, nbytes)  # fallocate does not shrink a larger file
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if prefault else 0)
            self._mmap = mmap.mmap(fd, nbytes, flags=flags)
        except BaseException:
            os.close(fd)
            if not self.attached:
                self.path.unlink(missing_ok=True)
            raise
        self._fd = fd  # holds the flock for the daemon's lifetime
        info = os.fstat(fd)
        self.inode = (info.st_dev, info.st_ino)  # staging must never be the arena (a hard link)
        self._anchor = ctypes.c_char.from_buffer(self._mmap)
        self.address = ctypes.addressof(self._anchor)
        self.view = memoryview(self._mmap)
        if lock:
            self._lock()

    def _reset_stale(self, fd: int, persistent: bool) -> None:
        """Our name, unlocked, with content: the arena of a daemon of ours that died. A private
        arena starts empty; a persistent one is re-attached unless its size changed."""
        size = os.fstat(fd).st_size
        if not size or (persistent and size == self.nbytes):
            return
        if persistent:
            log.warning("arena %s has %d bytes, the config says %d: starting it cold", self.path,
                        size, self.nbytes)
        else:
            log.warning("reclaimed the stale arena %s (%d bytes) of a daemon that died",
                        self.path, os.fstat(fd).st_blocks * 512)
            for path in index_files(self.path.parent, self.name):
                path.unlink(missing_ok=True)
        os.ftruncate(fd, 0)

    def _lock(self) -> None:
        if _libc.mlock(self.address, self.nbytes) == 0:
            self.locked = True
            return
        log.warning("could not mlock the %d-byte arena (%s); it may be swapped. %s", self.nbytes,
                    os.strerror(ctypes.get_errno()), _mlock_advice(ctypes.get_errno(), self.nbytes))

    def close(self, unlink: bool = True) -> None:
        if self._mmap.closed:
            return
        if self.locked:
            _libc.munlock(self.address, self.nbytes)
        self.view.release()
        del self._anchor
        self._mmap.close()
        if unlink:
            self.path.unlink(missing_ok=True)
        os.close(self._fd)


def _mlock_advice(err: int, nbytes: int) -> str:
    """What to change, from the actual cause: RLIMIT_MEMLOCK only binds without CAP_IPC_LOCK."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    capable = _has_capability(CAP_IPC_LOCK)
    if not capable and soft != resource.RLIM_INFINITY and soft < nbytes:
        return (f"RLIMIT_MEMLOCK is {soft} bytes: raise it (systemd: LimitMEMLOCK=infinity; "
                "docker run --ulimit memlock=-1) to pin it.")
    if err == errno.EPERM:
        return "Locking memory is not permitted here (no CAP_IPC_LOCK); set mlock = false."
    return ("RLIMIT_MEMLOCK allows it, so memory itself is short: the memory limit (cgroup "
            "memory.max, docker run --memory) or free RAM cannot hold the arena locked; lower "
            "cpu_bytes or raise the limit.")


def _has_capability(bit: int) -> bool:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> bit & 1)
    except OSError:
        pass
    return os.geteuid() == 0
