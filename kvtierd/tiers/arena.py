"""The pinned-CPU tier's memory: one named shared-memory region, mapped once.

The region is a file under /dev/shm so that it has a name (an operator can see it, a later warm
restart can re-attach to it). Fresh shm pages cost a page fault on first touch (~1 GB/s here), so the
arena is populated at start (``MAP_POPULATE``) and, where RLIMIT_MEMLOCK allows, locked so that it is
never swapped. CUDA registration of the same memory is the GPU path's job.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import logging
import mmap
import os
from pathlib import Path

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
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
        if persistent and self.path.exists() and self.path.stat().st_size != nbytes:
            log.warning("arena %s has %d bytes, the config says %d: starting it cold", self.path,
                        self.path.stat().st_size, nbytes)
            self.path.unlink()
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | (0 if persistent else os.O_EXCL)
        fd = os.open(self.path, flags, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # one daemon per arena
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(f"arena {self.path} is in use by another kvtierd") from None
        try:
            os.fchmod(fd, 0o600)  # every tenant's KV bytes: the daemon's alone (older files too)
            self.attached = os.fstat(fd).st_size == nbytes
            os.ftruncate(fd, nbytes)
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

    def _lock(self) -> None:
        if _libc.mlock(self.address, self.nbytes) == 0:
            self.locked = True
            return
        err = ctypes.get_errno()
        log.warning(
            "could not mlock the %d-byte arena (%s); it may be swapped. Raise RLIMIT_MEMLOCK "
            "(systemd: LimitMEMLOCK=infinity) to pin it.",
            self.nbytes,
            os.strerror(err),
        )

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
