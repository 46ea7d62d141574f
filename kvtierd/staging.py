"""Client staging buffers as the daemon sees them: verified before mapping, bounds-checked per item.

The seam every staging kind implements (the copy threads call the two copies):

* ``check_range(offset, nbytes)`` per item (None when inside),
* ``copy_in(offset, arena, segments) -> checksum``: staging ``[offset, offset + sum(lengths))`` →
  the arena ``segments`` (byte ranges in payload order), returning the payload's xxh3-128; for a
  PUT job, ``copy_in_ranges`` (one-range chunks) and ``copy_in_chunks`` (any) of many at once,
* ``copy_out_many(arena, srcs, dsts, sizes)``: a GET job's arena ranges → staging,
* ``close()`` once no copy uses it.

A client on the same host hands over a memfd by SCM_RIGHTS in the staging handshake
(``kvtierd.server.handshake``); ``MemfdStaging`` checks it *before* trusting it, because a mapping
whose pages disappear raises SIGBUS in the daemon on the next copy, killing it for every tenant, and
a page the daemon's copy has to allocate is charged to the daemon's memory cgroup, not the
client's:

* a regular file that is not the arena (a hard link to the arena would let a client write into
  every tenant's chunks);
* on shmem (``fstatfs`` f_type TMPFS_MAGIC): a hugetlbfs memfd (``MFD_HUGETLB``) passes every
  other check, but a client can punch a huge page out of it and take the page with another
  hugetlb memfd, and the daemon's next copy into that range is a SIGBUS;
* sealed with F_SEAL_SHRINK and F_SEAL_GROW (seals can never be removed, so the size announced is
  the size for the mapping's life: a later ``ftruncate`` fails with EPERM). Only memfds can carry
  these seals; a /dev/shm file reports F_SEAL_SEAL alone, a disk file or a pipe cannot be sealed;
* not sealed with F_SEAL_WRITE / F_SEAL_FUTURE_WRITE (GET writes into it) nor F_SEAL_SEAL (the
  daemon adds the last seals itself);
* exactly the announced size, in 1..max_staging_bytes.

Then the daemon maps it and seals it **F_SEAL_FUTURE_WRITE | F_SEAL_SEAL** itself. Mappings that
already exist (the client's, made before the handshake, and the daemon's) stay writable, but from
then on the kernel refuses ``fallocate(PUNCH_HOLE)`` and ``madvise(MADV_REMOVE)`` with EPERM
(shmem checks the seal; Linux 5.1 and later, verified at start by ``seal_protects``), as it
refuses new writable mappings and ``write(2)``. Only after sealing does it check for holes
(``SEEK_HOLE`` from 0 finds none before the end and ``st_blocks`` covers the size), so a hole
punched between the checks and the seal is seen too: every page is allocated, and charged to the
client, before the daemon's first copy, and none can be freed under it. Linux reports an
fallocated page that was never written as a hole, so clients fill their buffer.

Since the size cannot change, no per-batch size re-check is needed (protocol 1's named files
needed one and could still lose the race). The fd is closed once mapped: the mapping keeps the
memory alive, and nothing of a client's staging has a name anywhere.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import mmap
import os
import stat

from kvtierd.copy import memcpy
from kvtierd.protocol import ProtocolError, Status
from kvtierd.tiers.arena import Arena

F_SEAL_SEAL = getattr(fcntl, "F_SEAL_SEAL", 0x0001)
F_SEAL_SHRINK = getattr(fcntl, "F_SEAL_SHRINK", 0x0002)
F_SEAL_GROW = getattr(fcntl, "F_SEAL_GROW", 0x0004)
F_SEAL_WRITE = getattr(fcntl, "F_SEAL_WRITE", 0x0008)
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)  # Linux 5.1; not in fcntl
F_GET_SEALS = getattr(fcntl, "F_GET_SEALS", 1034)
F_ADD_SEALS = getattr(fcntl, "F_ADD_SEALS", 1033)
REQUIRED_SEALS = F_SEAL_SHRINK | F_SEAL_GROW
FORBIDDEN_SEALS = F_SEAL_WRITE | F_SEAL_FUTURE_WRITE | F_SEAL_SEAL
DAEMON_SEALS = F_SEAL_FUTURE_WRITE | F_SEAL_SEAL  # added by the daemon once both sides mapped
TMPFS_MAGIC = 0x01021994  # shmem: memfd_create without MFD_HUGETLB
HUGETLBFS_MAGIC = 0x958458F6
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.fstatfs.argtypes = (ctypes.c_int, ctypes.c_void_p)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)


class _StatFs(ctypes.Structure):
    # struct statfs begins with __fsword_t f_type (a long on every 64-bit Linux); the rest is
    # room for the other fields (120 bytes on x86_64 and aarch64), never read here.
    _fields_ = [("f_type", ctypes.c_long), ("_rest", ctypes.c_char * 248)]


def filesystem_type(fd: int) -> int:
    """``fstatfs(fd).f_type``: the magic number of the file system ``fd`` lives on."""
    info = _StatFs()
    if _libc.fstatfs(fd, ctypes.byref(info)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return info.f_type & 0xFFFFFFFF


def _refuse(message: str) -> ProtocolError:
    return ProtocolError(Status.BAD_HANDLE, message)


def verify_memfd(fd: int, nbytes: object, max_bytes: int, arena_inode: tuple[int, int]) -> int:
    """Check that ``fd`` is staging the daemon can map safely; return its size or raise
    BAD_HANDLE naming what is wrong and what is allowed."""
    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or not 0 < nbytes <= max_bytes:
        raise _refuse(f"staging nbytes {nbytes!r:.40} must be an int in 1..{max_bytes}")
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise _refuse(f"staging fd is a {_file_type(info.st_mode)}, not a memfd; allowed: a "
                      "sealed memfd (memfd_create with MFD_ALLOW_SEALING)")
    if (info.st_dev, info.st_ino) == arena_inode:
        raise _refuse("staging fd is the daemon's own arena; allowed: a memfd of your own")
    try:
        seals = fcntl.fcntl(fd, F_GET_SEALS)
    except OSError as exc:
        raise _refuse(f"staging fd cannot carry seals ({exc.strerror}): it is not a memfd; "
                      "allowed: a sealed memfd (memfd_create with MFD_ALLOW_SEALING)") from None
    if seals & REQUIRED_SEALS != REQUIRED_SEALS:
        raise _refuse(f"staging memfd seals are {_seal_names(seals)}; required: F_SEAL_SHRINK and "
                      "F_SEAL_GROW (a /dev/shm file or an unsealed memfd could be truncated)")
    if seals & FORBIDDEN_SEALS:
        raise _refuse(f"staging memfd seals are {_seal_names(seals)}; F_SEAL_WRITE and "
                      "F_SEAL_FUTURE_WRITE are not allowed (GET writes into the buffer), nor "
                      "F_SEAL_SEAL (the daemon adds F_SEAL_FUTURE_WRITE | F_SEAL_SEAL once it has "
                      "mapped the buffer; map yours before the handshake)")
    fs_type = filesystem_type(fd)
    if fs_type != TMPFS_MAGIC:
        what = ("a hugetlbfs memfd (MFD_HUGETLB), whose huge pages a client can punch out and "
                "reuse under the daemon's mapping" if fs_type == HUGETLBFS_MAGIC
                else f"on a file system of type {fs_type:#x}")
        raise _refuse(f"staging fd is {what}; allowed: a shmem memfd (memfd_create with "
                      f"MFD_ALLOW_SEALING and without MFD_HUGETLB, file system type "
                      f"{TMPFS_MAGIC:#x})")
    if info.st_size != nbytes:
        raise _refuse(f"staging memfd has {info.st_size} bytes, the handshake announced {nbytes}; "
                      "allowed: exactly the announced size")
    return nbytes


def seal_mapped(fd: int, nbytes: int) -> None:
    """Add ``DAEMON_SEALS`` (the daemon has mapped ``fd``), then check that no page is a hole:
    from here on none can become one."""
    try:
        fcntl.fcntl(fd, F_ADD_SEALS, DAEMON_SEALS)
    except OSError as exc:
        raise _refuse(f"cannot seal the staging memfd F_SEAL_FUTURE_WRITE | F_SEAL_SEAL "
                      f"({exc.strerror}); allowed: a memfd sealed only F_SEAL_SHRINK | "
                      "F_SEAL_GROW by the client") from None
    info = os.fstat(fd)
    hole = os.lseek(fd, 0, os.SEEK_HOLE)
    if hole < nbytes or info.st_blocks * 512 < nbytes:
        raise _refuse(f"staging memfd has holes (first at byte {hole}, {info.st_blocks * 512} of "
                      f"{nbytes} bytes allocated); allowed: a memfd fallocated and written in "
                      "full before the handshake")


def seal_protects() -> str | None:
    """Why this kernel does not keep a FUTURE_WRITE-sealed memfd's pages (None: it does): the
    seal must make ``fallocate(PUNCH_HOLE)`` fail with EPERM while an existing writable mapping
    stays writable. Checked once at start on a one-page memfd."""
    page = mmap.PAGESIZE
    fd = os.memfd_create("kvtierd-seal-probe", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, page)
        os.pwrite(fd, b"\x01" * page, 0)
        with mmap.mmap(fd, page, flags=mmap.MAP_SHARED) as mapped:
            try:
                fcntl.fcntl(fd, F_ADD_SEALS, REQUIRED_SEALS | DAEMON_SEALS)
            except OSError as exc:
                return f"F_SEAL_FUTURE_WRITE is refused ({exc.strerror}; Linux 5.1 added it)"
            mapped[0] = 2  # the existing mapping stays writable
            if _libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, page) == 0:
                return "fallocate(PUNCH_HOLE) succeeds on a F_SEAL_FUTURE_WRITE-sealed memfd"
            if ctypes.get_errno() != errno.EPERM:
                return (f"fallocate(PUNCH_HOLE) on a sealed memfd failed with "
                        f"{os.strerror(ctypes.get_errno())}, not EPERM")
        return None
    finally:
        os.close(fd)


def _file_type(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "pipe"), (stat.S_ISSOCK, "socket"), (stat.S_ISDIR,
                       "directory"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK,
                       "block device")):
        if test(mode):
            return name
    return f"file of mode {mode:o}"


def _seal_names(seals: int) -> str:
    names = [name for bit, name in ((F_SEAL_SEAL, "F_SEAL_SEAL"), (F_SEAL_SHRINK, "F_SEAL_SHRINK"),
             (F_SEAL_GROW, "F_SEAL_GROW"), (F_SEAL_WRITE, "F_SEAL_WRITE"),
             (F_SEAL_FUTURE_WRITE, "F_SEAL_FUTURE_WRITE")) if seals & bit]
    return "|".join(names) or "none"


class MemfdStaging:
    """A client's verified memfd staging buffer, mapped read-write by the daemon."""

    kind = "memfd"

    def __init__(self, fd: int, nbytes: object, max_bytes: int,
                 arena_inode: tuple[int, int]) -> None:
        """Verify and map ``fd`` (the caller keeps ownership of ``fd`` and closes it)."""
        self.nbytes = verify_memfd(fd, nbytes, max_bytes, arena_inode)
        try:
            self._mmap = mmap.mmap(fd, self.nbytes, flags=mmap.MAP_SHARED)
        except OSError as exc:
            raise _refuse(f"cannot map the staging memfd: {exc.strerror}") from None
        try:
            seal_mapped(fd, self.nbytes)
        except BaseException:
            self._mmap.close()
            raise
        self.name = f"memfd:{self.nbytes}"
        self._anchor = ctypes.c_char.from_buffer(self._mmap)
        self.address = ctypes.addressof(self._anchor)
        self.view = memoryview(self._mmap)

    def copy_in(self, offset: int, arena: Arena, segments: list[tuple[int, int]]) -> bytes:
        return memcpy.copy_in(self.address, offset, arena.address, segments, arena.view)

    def copy_in_ranges(self, arena: Arena, srcs: list[int], dsts: list[int],
                       sizes: int | list[int]) -> list[bytes]:
        """``sizes`` (or ``sizes[i]``) bytes at staging offset ``srcs[i]`` → arena offset
        ``dsts[i]``; checksums."""
        return memcpy.copy_in_ranges(self.address, srcs, arena.address, dsts, sizes, arena.view)

    def copy_in_chunks(self, arena: Arena, offsets: list[int],
                       segments: list[list[tuple[int, int]]]) -> list[bytes]:
        """``copy_in`` of each ``(offsets[j], segments[j])``; checksums."""
        return memcpy.copy_in_chunks(self.address, offsets, arena.address, segments, arena.view)

    def copy_out_many(self, arena: Arena, srcs: list[int], dsts: list[int],
                      sizes: list[int]) -> None:
        """``sizes[i]`` bytes at arena offset ``srcs[i]`` → staging offset ``dsts[i]``."""
        memcpy.copy_out_many(arena.address, srcs, self.address, dsts, sizes)

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

    @property
    def closed(self) -> bool:
        return self._mmap.closed

    def close(self) -> None:
        if self._mmap.closed:
            return
        self.view.release()
        del self._anchor
        self._mmap.close()
