"""The staging handshake: a Unix stream socket where a client proves who it is and hands over its
staging memfd (the wire format is in ``kvtierd.protocol``'s docstring).

It runs on a thread of its own with non-blocking connections in one selector, so nothing a client
does here reaches the request loop: a connection that sends nothing is closed at its deadline
(``DEADLINE_S``), garbage or more than ``MAX_HANDSHAKE_BYTES`` is answered and closed at once, at
most ``MAX_CONNECTIONS`` handshakes are open together and ``MAX_CONNECTIONS_PER_UID`` of one user
(more are answered BUSY and closed). The message is exactly one msgpack map whose ``v`` is the
integer ``PROTOCOL_VERSION``; anything after the map is refused.

Descriptors: a handshake carries at most one (a memfd), and a connection that ever carries a
second one is refused at once and every descriptor it brought closed, whatever the read
boundaries (a client that trickles a message in 1-byte ``sendmsg`` calls, each with descriptors,
would otherwise make one connection hold thousands until its message completes, and libzmq aborts
the daemon at the first EMFILE). The control buffer has room for ``MAX_FDS`` = 2, so a read sees
one too many; the kernel closes what does not fit. A received memfd is closed once the handshake
ends (its mapping keeps it alive). Credentials come from SO_PEERCRED of the connection, never from
the message, translated by ``kvtierd.peer.UserNamespace``.

A successful handshake leaves a ticket in the ``TicketBook``; the HELLO presenting it gets the
peer and (memfd) the verified mapping.
"""

from __future__ import annotations

import errno
import logging
import os
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import msgpack

from kvtierd.peer import Peer, UserNamespace, read_user_namespace
from kvtierd.protocol import (
    MAX_HANDSHAKE_BYTES,
    PROTOCOL_VERSION,
    STAGING_KINDS,
    ProtocolError,
    Status,
    pack,
)
from kvtierd.server.tickets import TicketBook

log = logging.getLogger(__name__)

DEADLINE_S = 2.0  # a handshake must be complete this long after connect
MAX_CONNECTIONS = 64  # handshakes in progress at once
MAX_CONNECTIONS_PER_UID = 16  # ... of one user: its silent connections cannot lock others out
BACKLOG = 256  # connections the kernel queues before the thread accepts them
DRAIN_BYTES = 256 * 1024  # unread input discarded before a close, so that the answer arrives
MAX_FDS = 2  # control-buffer room: one allowed descriptor and one to see that there are too many
MAX_FDS_PER_CONNECTION = 1  # a memfd; cuda_ipc and inline carry none
_UCRED = struct.Struct("=iII")  # struct ucred: pid_t pid; uid_t uid; gid_t gid

#: ``open_memfd(fd, nbytes) -> staging``: verify and map (raises ProtocolError BAD_HANDLE).
OpenMemfd = Callable[[int, Any], Any]


@dataclass
class _Conn:
    sock: socket.socket
    peer: Peer
    deadline: float
    data: bytearray = field(default_factory=bytearray)
    fds: list[int] = field(default_factory=list)
    truncated: bool = False  # the control data did not fit: more descriptors than MAX_FDS


def peer_of(sock: socket.socket, userns: UserNamespace) -> Peer:
    """The connected process's credentials as the kernel recorded them at connect (translated
    into the daemon's user namespace)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    return userns.peer(uid, gid, pid)


def reply(status: Status, message: str = "", ticket: bytes = b"", expires_s: float = 0.0) -> bytes:
    return pack({"v": PROTOCOL_VERSION, "status": int(status), "name": status.name,
                 "message": message, "ticket": ticket, "expires_s": expires_s})


class HandshakeServer:
    def __init__(self, path: Path, mode: int, tickets: TicketBook, open_memfd: OpenMemfd,
                 max_staging_bytes: int, counter: Any = None,
                 userns: UserNamespace | None = None) -> None:
        """``counter``: a prometheus Counter labelled (kind, status), or None; ``userns``: the
        daemon's user namespace (read from /proc when None)."""
        self.path = path
        self.userns = userns or read_user_namespace()
        self.mode = mode
        self.tickets = tickets
        self.open_memfd = open_memfd
        self.max_staging_bytes = max_staging_bytes
        self.counts = {"ok": 0, "refused": 0}  # read by STATS (ints: torn reads are harmless)
        self._counter = counter
        self._listener: socket.socket | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    def bind(self) -> None:
        """Bind and listen (the caller already claimed the path); the socket gets ``mode``."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            listener.bind(str(self.path))
            os.chmod(self.path, self.mode)
            listener.listen(BACKLOG)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            raise
        self._listener = listener

    def start(self) -> None:
        assert self._listener is not None, "bind() first"
        self._thread = threading.Thread(target=self._run, name="kvtierd-handshake", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._listener is not None:
            self._listener.close()
            self.path.unlink(missing_ok=True)
        self._wake_r.close()
        self._wake_w.close()

    # -- the thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        assert self._listener is not None
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ, None)
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        conns: dict[int, _Conn] = {}
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                timeout = min((c.deadline for c in conns.values()), default=now + 1.0) - now
                for key, _ in sel.select(max(0.0, timeout)):
                    if key.fileobj is self._listener:
                        self._accept(sel, conns)
                    elif key.fileobj is not self._wake_r:
                        self._readable(sel, conns, key.data)
                now = time.monotonic()
                for conn in [c for c in conns.values() if c.deadline <= now]:
                    self._count("invalid", Status.BAD_MESSAGE)
                    self._finish(sel, conns, conn, reply(
                        Status.BAD_MESSAGE, f"no complete handshake within {DEADLINE_S:g} s"))
        except Exception:  # a bug here must not leave clients hanging silently: log it loudly
            log.exception("the staging handshake thread failed; new sessions cannot get staging")
        finally:
            for conn in list(conns.values()):
                self._finish(sel, conns, conn, reply(Status.SHUTTING_DOWN, "kvtierd is stopping"))
            sel.close()

    def _accept(self, sel: selectors.BaseSelector, conns: dict[int, _Conn]) -> None:
        assert self._listener is not None
        for _ in range(MAX_CONNECTIONS):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE/ENFILE: refuse this round, never die
                log.warning("handshake accept failed: %s", exc.strerror)
                return
            sock.setblocking(False)
            if len(conns) >= MAX_CONNECTIONS:
                _send_and_close(sock, reply(Status.BUSY, f"{len(conns)} handshakes in progress "
                                            f"(the limit is {MAX_CONNECTIONS}); retry shortly"))
                self._count("invalid", Status.BUSY)
                continue
            try:
                peer = peer_of(sock, self.userns)
            except OSError as exc:  # the peer is already gone
                log.debug("handshake peer credentials unreadable: %s", exc.strerror)
                sock.close()
                continue
            mine = sum(1 for c in conns.values() if c.peer.uid == peer.uid)
            if mine >= MAX_CONNECTIONS_PER_UID:
                _send_and_close(sock, reply(Status.BUSY, f"{mine} handshakes of uid {peer.uid} in "
                                            f"progress (the limit per user is "
                                            f"{MAX_CONNECTIONS_PER_UID}); retry shortly"))
                self._count("invalid", Status.BUSY)
                continue
            conn = _Conn(sock, peer, time.monotonic() + DEADLINE_S)
            conns[sock.fileno()] = conn
            sel.register(sock, selectors.EVENT_READ, conn)

    def _readable(self, sel: selectors.BaseSelector, conns: dict[int, _Conn], conn: _Conn) -> None:
        room = MAX_HANDSHAKE_BYTES + 1 - len(conn.data)
        try:
            data, fds, flags, _ = socket.recv_fds(conn.sock, room, MAX_FDS)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._finish(sel, conns, conn, None, f"read failed: {exc.strerror}")
            return
        conn.fds.extend(fds)
        conn.truncated |= bool(flags & socket.MSG_CTRUNC)
        if conn.truncated or len(conn.fds) > MAX_FDS_PER_CONNECTION:
            self._count("invalid", Status.BAD_HANDLE)
            self._finish(sel, conns, conn, reply(
                Status.BAD_HANDLE, f"handshake carries more than {MAX_FDS_PER_CONNECTION} file "
                "descriptor; allowed: exactly one memfd for kind memfd, none for the other kinds, "
                "in the sendmsg of the message"))
            return
        conn.data += data
        if len(conn.data) > MAX_HANDSHAKE_BYTES:
            self._count("invalid", Status.TOO_LARGE)
            self._finish(sel, conns, conn, reply(
                Status.TOO_LARGE, f"handshake message is over {MAX_HANDSHAKE_BYTES} bytes; "
                f"allowed: one msgpack map of at most {MAX_HANDSHAKE_BYTES} bytes"))
            return
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=True,
                                    max_buffer_size=MAX_HANDSHAKE_BYTES)
        unpacker.feed(bytes(conn.data))
        try:
            message = unpacker.unpack()
        except msgpack.OutOfData:
            if not data:  # EOF before a whole message
                self._finish(sel, conns, conn, None, "closed before a whole message")
            return
        except Exception as exc:  # msgpack raises several unrelated types for bad input
            self._count("invalid", Status.BAD_MESSAGE)
            self._finish(sel, conns, conn, reply(
                Status.BAD_MESSAGE, f"handshake is not valid msgpack: {exc}"))
            return
        self._finish(sel, conns, conn,
                     self._answer(conn, message, len(conn.data) - unpacker.tell()))

    def _answer(self, conn: _Conn, message: Any, extra: int) -> bytes:
        """``extra``: bytes that followed the message's map."""
        try:
            kind, nbytes = self._check(conn, message, extra)
            staging = self.open_memfd(conn.fds[0], nbytes) if kind == "memfd" else None
            try:
                ticket = self.tickets.issue(kind, conn.peer, nbytes, staging)
            except BaseException:
                if staging is not None:
                    staging.close()
                raise
        except ProtocolError as exc:
            self._count(_kind_label(message), exc.status)
            log.info("staging handshake of %s refused: %s: %s", conn.peer.describe(),
                     exc.status.name, exc.message)
            return reply(exc.status, exc.message)
        except Exception as exc:
            self._count(_kind_label(message), Status.INTERNAL)
            log.exception("staging handshake of %s failed", conn.peer.describe())
            return reply(Status.INTERNAL, f"internal error: {exc}")
        self._count(kind, Status.OK)
        log.debug("staging handshake of %s: %s, %d bytes", conn.peer.describe(), kind, nbytes)
        return reply(Status.OK, ticket=ticket, expires_s=self.tickets.ttl_s)

    def _count(self, kind: str, status: Status) -> None:
        self.counts["ok" if status is Status.OK else "refused"] += 1
        if self._counter is not None:
            self._counter.labels(kind, status.name).inc()

    def _check(self, conn: _Conn, message: Any, extra: int) -> tuple[str, int]:
        if not isinstance(message, dict):
            raise ProtocolError(Status.BAD_MESSAGE, f"handshake must be a msgpack map, got "
                                f"{type(message).__name__}")
        if extra:
            raise ProtocolError(Status.BAD_MESSAGE, f"{extra} byte(s) follow the handshake map; "
                                "allowed: exactly one msgpack map")
        version = message.get("v")
        if type(version) is not int or version != PROTOCOL_VERSION:  # not 3.0, not True
            raise ProtocolError(Status.UNSUPPORTED_VERSION, f"handshake version "
                                f"{version!r:.40} is not supported; this daemon speaks "
                                f"{PROTOCOL_VERSION} (the integer)")
        kind = message.get("kind")
        if kind not in STAGING_KINDS:
            raise ProtocolError(Status.BAD_HANDLE, f"handshake kind {kind!r:.40} is unknown; "
                                f"allowed: {', '.join(STAGING_KINDS)}")
        wanted = 1 if kind == "memfd" else 0
        if conn.truncated or len(conn.fds) != wanted:
            got = f"more than {MAX_FDS}" if conn.truncated else str(len(conn.fds))
            raise ProtocolError(Status.BAD_HANDLE, f"handshake kind {kind!r} carries {got} file "
                                f"descriptor(s); allowed: exactly {wanted}")
        nbytes = message.get("nbytes", 0)
        if kind == "inline":
            return kind, 0
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or not (
                0 < nbytes <= self.max_staging_bytes):
            raise ProtocolError(Status.BAD_HANDLE, f"staging nbytes {nbytes!r:.40} must be an int "
                                f"in 1..{self.max_staging_bytes}")
        return kind, nbytes

    def _finish(self, sel: selectors.BaseSelector, conns: dict[int, _Conn], conn: _Conn,
                answer: bytes | None, why: str = "") -> None:
        if why:
            log.debug("staging handshake of %s dropped: %s", conn.peer.describe(), why)
        conns.pop(conn.sock.fileno(), None)
        sel.unregister(conn.sock)
        for fd in conn.fds:  # the mapping (if any) keeps a verified memfd alive
            os.close(fd)
        conn.fds.clear()
        if answer is None:
            conn.sock.close()
        else:
            _send_and_close(conn.sock, answer)


def _kind_label(message: Any) -> str:
    """A bounded metrics label: the handshake's kind when it is a known one."""
    kind = message.get("kind") if isinstance(message, dict) else None
    return kind if kind in STAGING_KINDS else "invalid"


def _send_and_close(sock: socket.socket, data: bytes) -> None:
    """Best effort: a reply of a few hundred bytes fits any socket buffer; a peer that is gone or
    that never reads only loses its own answer. Closing a Unix socket with unread input resets the
    peer before it reads the answer, so input already queued is discarded first (bounded: a peer
    that keeps streaming gets the reset)."""
    try:
        sock.send(data)
        drained = 0
        while drained < DRAIN_BYTES:
            chunk = sock.recv(65536, socket.MSG_DONTWAIT)
            if not chunk:
                break
            drained += len(chunk)
    except OSError as exc:
        if exc.errno not in (errno.EPIPE, errno.ECONNRESET, errno.EAGAIN):
            log.debug("handshake reply not sent: %s", exc.strerror)
    finally:
        sock.close()
