"""Raw staging for protocol tests: a memfd made (and, on request, mis-made) the way a client makes
one, handed to a real daemon over its staging handshake socket.

Use it for "a raw session with memfd staging"::

    buf = MemfdBuffer(1 << 20, fill=0x11)          # sealed, fallocated, written, mapped here
    staging = buf.hello_staging(daemon.address)     # handshake (fd by SCM_RIGHTS) -> HELLO map
    raw.request(Op.HELLO, ..., staging=staging)

``helpers.bad_input.Session(address, ns, staging=buf)`` does those two steps itself. For
attacks, ``MemfdBuffer(..., seals=..., allocate=False)`` makes unsealed or sparse memfds and
``send_handshake`` sends any bytes with any descriptors and returns the daemon's raw answer.

The buffer is mapped here up to the end of its last page: ``tail`` is what lies past the announced
size in that page (the daemon's mapping reaches it too), so a test can fill it with a sentinel and
prove that nothing was written past the buffer.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import mmap
import os
import socket
from typing import Any, Sequence

import msgpack

from kvtier_client.handshake import connect
from kvtierd.control import call
from kvtierd.protocol import PROTOCOL_VERSION, Op

PAGE = mmap.PAGESIZE
SEALED = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW  # as kvtier_client seals; the daemon adds the rest
F_SEAL_WRITE = fcntl.F_SEAL_WRITE
F_SEAL_FUTURE_WRITE = 0x0010  # Linux 5.1; not in Python's fcntl module
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_MAP_FAILED = ctypes.c_void_p(-1).value


def handshake_path(address: str) -> str:
    """Where the daemon at ``address`` takes staging handshakes (its PING reply says)."""
    return call(address, Op.PING)["handshake"]


def send_handshake(path: str, message: Any, fds: Sequence[int] = (), timeout_s: float = 5.0,
                   ) -> dict:
    """Send ``message`` (a dict is packed; bytes go as they are) with ``fds`` in one sendmsg and
    return the daemon's answer map."""
    data = message if isinstance(message, bytes) else msgpack.packb(message, use_bin_type=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        connect(sock, path, timeout_s)
        sent = socket.send_fds(sock, [data], list(fds)) if fds else sock.send(data)
        if sent < len(data):
            sock.sendall(data[sent:])
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return msgpack.unpackb(answer, raw=False)


def handshake(path: str, kind: str, nbytes: int = 0, fds: Sequence[int] = ()) -> dict:
    """One well-formed handshake message of ``kind``; the daemon's answer map."""
    return send_handshake(path, {"v": PROTOCOL_VERSION, "kind": kind, "nbytes": nbytes}, fds)


def ticket(address: str, kind: str, nbytes: int = 0, fds: Sequence[int] = ()) -> bytes:
    """A ticket for ``kind`` (asserting the daemon granted it)."""
    answer = handshake(handshake_path(address), kind, nbytes, fds)
    assert answer["name"] == "OK", answer
    assert len(answer["ticket"]) == 16 and answer["expires_s"] > 0, answer
    return answer["ticket"]


def inline_staging(address: str) -> dict:
    """HELLO's ``staging`` for an inline session with our credentials (an inline handshake's
    ticket): what a local client without shared memory sends. Without the ticket the session
    would be the ``anonymous`` tenant, which an ipc daemon refuses by default."""
    return {"kind": "inline", "ticket": ticket(address, "inline")}


class MemfdBuffer:
    """A staging memfd of ``nbytes`` mapped here (to the end of its last page).

    Defaults make what ``kvtier_client`` makes: fallocated, every page written, sealed
    ``SEALED``. ``seals`` (0: none) and ``allocate=False`` (sparse: ftruncate only) make the bad
    ones (those two, and write-sealed ones, are not mapped here). ``fill`` writes a byte over the
    whole mapping, tail included.
    """

    def __init__(self, nbytes: int, fill: int = 0, *, seals: int = SEALED,
                 allocate: bool = True) -> None:
        self.nbytes = nbytes
        self.fd = os.memfd_create("kvtier-test-staging", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        self.size = -(-nbytes // PAGE) * PAGE  # mapped bytes: up to the end of the last page
        self.address = 0
        try:
            os.ftruncate(self.fd, nbytes)
            if allocate:
                os.posix_fallocate(self.fd, 0, nbytes)
                os.pwrite(self.fd, bytes(nbytes), 0)  # written: no page left a hole
            if seals:
                fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, seals)
            if not allocate or seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE):
                return  # not mapped: touching a sparse buffer would allocate its pages, and a
                # write-sealed one cannot be mapped writable
            address = _libc.mmap(None, self.size, mmap.PROT_READ | mmap.PROT_WRITE,
                                 mmap.MAP_SHARED, self.fd, 0)
            if address in (None, _MAP_FAILED):
                raise OSError(ctypes.get_errno(), "mmap of the test staging memfd failed")
            self.address = address
        except BaseException:
            self.close()
            raise
        if fill:
            self.fill(fill)

    @property
    def tail(self) -> tuple[int, int]:
        """``(start, end)`` of the bytes past ``nbytes`` in the last page."""
        return self.nbytes, self.size

    def hello_staging(self, address: str) -> dict:
        """Hand the fd to the daemon at ``address``; HELLO's ``staging`` map with the ticket."""
        return {"kind": "memfd", "ticket": ticket(address, "memfd", self.nbytes, [self.fd])}

    def fill(self, byte: int, start: int = 0, end: int | None = None) -> None:
        end = self.size if end is None else end
        ctypes.memset(self.address + start, byte, end - start)

    def write(self, offset: int, data: bytes) -> None:
        assert 0 <= offset and offset + len(data) <= self.size
        ctypes.memmove(self.address + offset, data, len(data))

    def read(self, offset: int, nbytes: int) -> bytes:
        assert 0 <= offset and offset + nbytes <= self.size
        return ctypes.string_at(self.address + offset, nbytes)

    def close(self) -> None:
        if self.address:
            _libc.munmap(self.address, self.size)
            self.address = 0
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
