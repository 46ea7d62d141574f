"""The client's host staging buffer: a sealed memfd handed to the daemon (CPU-only path).

It has no name anywhere, so no other process can open, swap or truncate it; the daemon gets it only
as a descriptor over the staging handshake (``handshake``). Before that it is made safe to map for
a process that does not trust us:

* ``memfd_create(MFD_CLOEXEC | MFD_ALLOW_SEALING)`` and ``ftruncate`` to the size;
* ``posix_fallocate`` so that every page is allocated now, charged to this process: a failure
  (ENOSPC/ENOMEM) is a clear error here, not a SIGBUS at the first copy;
* every page written once (Linux reports a fallocated page that was never written as a hole, and
  the daemon refuses buffers with holes);
* mapped here, then sealed ``F_SEAL_SHRINK | F_SEAL_GROW``: its size can never change again, by us
  or anyone, so the daemon's mapping cannot fault. The daemon maps it too and adds
  ``F_SEAL_FUTURE_WRITE | F_SEAL_SEAL`` (protocol 3): both mappings stay writable, but no page
  can be punched out of the buffer any more, so the daemon never allocates memory on our behalf.
  That is why we must not seal it F_SEAL_SEAL ourselves, and why the mapping comes first (no new
  writable mapping can be made after the daemon's seal).

Our descriptor is closed once the daemon has its own (``release_fd``); the memory lives as long as
either side maps it, so a ``kill -9`` of either leaves nothing behind.
"""

from __future__ import annotations

import fcntl
import mmap
import os

import torch

MEMFD_NAME = "kvtier-staging"
ALIGN = 256  # unit offsets in staging: enough for 16-byte vector copies and DMA-friendly
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW  # the daemon adds FUTURE_WRITE | SEAL
_FILL_STEP = 4 * 1024**2


class StagingAllocationError(MemoryError):
    """The memory for a staging buffer could not be reserved."""


class MemfdStagingBuffer:
    handshake_kind = "memfd"

    def __init__(self, nbytes: int) -> None:
        if nbytes <= 0:
            raise ValueError(f"staging_bytes={nbytes}; allowed: a positive size")
        self.nbytes = nbytes
        # The name is only a label in /proc/<pid>/maps (memfds have no path): ours carries the pid.
        fd = os.memfd_create(f"{MEMFD_NAME}-{os.getpid()}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            try:
                os.ftruncate(fd, nbytes)
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:  # ENOSPC/ENOMEM (memory limit), EFBIG (RLIMIT_FSIZE)
                raise StagingAllocationError(
                    f"cannot allocate a {nbytes}-byte staging buffer ({exc.strerror}): free "
                    "memory, raise the process's memory limit (container/cgroup) or its file "
                    "size limit, or pass a smaller staging_bytes") from None
            _fill(fd, nbytes)
            self._mmap = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        except BaseException:
            os.close(fd)
            raise
        self.fd: int | None = fd
        self.tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)

    def handle(self, ticket: bytes) -> dict:
        """HELLO's ``staging`` once the handshake handed the fd over and returned ``ticket``."""
        return {"kind": "memfd", "ticket": ticket}

    def release_fd(self) -> None:
        """The daemon holds its own descriptor (or mapping) now: ours is no longer needed."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def close(self) -> None:
        self.release_fd()
        if not self._mmap.closed:
            del self.tensor
            self._mmap.close()


def _fill(fd: int, nbytes: int) -> None:
    """Write every page once (zeros), so that none is left a hole."""
    zeros = bytes(min(_FILL_STEP, nbytes))
    offset = 0
    while offset < nbytes:
        step = min(_FILL_STEP, nbytes - offset)
        offset += os.pwrite(fd, zeros[:step] if step < len(zeros) else zeros, offset)


def align(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN
