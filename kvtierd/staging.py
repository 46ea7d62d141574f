"""Client staging buffers as the daemon sees them: opened once per session, bounds-checked.

The seam every staging kind implements (the copy threads call the two copies):

* ``check_size()`` before each batch, ``check_range(offset, nbytes)`` per item (None when inside),
* ``copy_in(offset, arena, segments) -> checksum``: staging ``[offset, offset + sum(lengths))`` →
  the arena ``segments`` (byte ranges in payload order), returning the payload's xxh3-128,
* ``copy_out(arena, segments, offset)``: the reverse,
* ``close()`` once no copy uses it.

A client on the same host registers a shared-memory file it created under /dev/shm (name pattern
``kvtier-stg-*``) in HELLO; the daemon maps it and copies between it and its tiers. Every
``(offset, nbytes)`` of a request is checked against the registered size before any copy. The client
may unlink the file once HELLO is answered: the mapping keeps the memory alive, and nothing is left in
/dev/shm if either side dies.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import stat
from pathlib import Path

from kvtierd.copy import memcpy
from kvtierd.protocol import ProtocolError, Status
from kvtierd.tiers.arena import Arena

SHM_DIR = Path("/dev/shm")
NAME_PATTERN = re.compile(r"^kvtier-stg-[A-Za-z0-9_.-]{1,200}$")


class ShmStaging:
    """A client's shared-memory staging buffer, mapped read-write by the daemon."""

    kind = "shm"

    def __init__(self, name: str, nbytes: int, max_bytes: int) -> None:
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            raise ProtocolError(
                Status.BAD_HANDLE,
                f"staging name {name!r} is not allowed; expected a /dev/shm file name matching "
                f"{NAME_PATTERN.pattern}",
            )
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or not 0 < nbytes <= max_bytes:
            raise ProtocolError(
                Status.BAD_HANDLE, f"staging nbytes {nbytes!r} must be an int in 1..{max_bytes}"
            )
        try:
            fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise ProtocolError(
                Status.BAD_HANDLE, f"cannot open staging buffer /dev/shm/{name}: {exc.strerror}"
            ) from None
        self._fd = fd  # kept: every batch re-checks the size (see check_size)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise ProtocolError(Status.BAD_HANDLE, f"/dev/shm/{name} is not a regular file")
            if info.st_size < nbytes:
                raise ProtocolError(
                    Status.BAD_HANDLE,
                    f"staging buffer /dev/shm/{name} has {info.st_size} bytes, "
                    f"fewer than the {nbytes} announced",
                )
            self._mmap = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
        self.name = name
        self.nbytes = nbytes
        self._anchor = ctypes.c_char.from_buffer(self._mmap)
        self.address = ctypes.addressof(self._anchor)
        self.view = memoryview(self._mmap)

    def copy_in(self, offset: int, arena: Arena, segments: list[tuple[int, int]]) -> bytes:
        return memcpy.copy_in(self.address, offset, arena.address, segments, arena.view)

    def copy_out(self, arena: Arena, segments: list[tuple[int, int]], offset: int) -> None:
        memcpy.copy_out(arena.address, segments, self.address, offset)

    def check_size(self) -> None:
        """Refuse a batch if the client shrank its file since HELLO.

        A copy through a mapping whose file was truncated would raise SIGBUS and kill the daemon.
        This check catches a buggy client; a client racing a truncate against its own in-flight
        request can still win (named /dev/shm files cannot be sealed) — sealed memfds passed over
        SCM_RIGHTS are the fix for that threat.
        """
        size = os.fstat(self._fd).st_size
        if size < self.nbytes:
            raise ProtocolError(
                Status.BAD_HANDLE,
                f"staging buffer /dev/shm/{self.name} shrank to {size} bytes since HELLO "
                f"({self.nbytes} announced); nothing was copied",
            )

    def check_range(self, offset: object, nbytes: object) -> str | None:
        """Why ``(offset, nbytes)`` is not inside the buffer, or None when it is."""
        if not isinstance(offset, int) or not isinstance(nbytes, int):
            return f"offset and nbytes must be ints, got {offset!r}, {nbytes!r}"
        if offset < 0 or nbytes <= 0 or offset + nbytes > self.nbytes:
            return (
                f"range [{offset}, {offset}+{nbytes}) is outside the staging buffer "
                f"[0, {self.nbytes})"
            )
        return None

    def close(self) -> None:
        if self._mmap.closed:
            return
        self.view.release()
        del self._anchor
        self._mmap.close()
        os.close(self._fd)
