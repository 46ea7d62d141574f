"""The client side of the staging handshake (wire format: ``kvtierd.protocol``'s docstring).

``handshake(path, kind, nbytes, fd)`` connects to the daemon's Unix handshake socket, sends one
msgpack map (and, for ``memfd``, the descriptor by SCM_RIGHTS in the same ``sendmsg``), and
returns the one-time ticket HELLO presents. The daemon learns who we are from the socket
(SO_PEERCRED), so nothing here claims an identity. ``handshake_path(transport)`` asks the daemon
(PING) where its handshake socket is; ``inline_staging`` is the HELLO staging of a session without
shared memory (``KVTierIndex``), with the credentials when the daemon is local.
"""

from __future__ import annotations

import os
import socket
import struct
from typing import Any

import msgpack

from kvtierd.protocol import MAX_HANDSHAKE_BYTES, PROTOCOL_VERSION, Op, Status, status_name

from .transport import DaemonError, DaemonUnavailable


class HandshakeError(DaemonError):
    """The daemon refused the staging handshake (``status`` is a ``Status`` number); callers
    that handle a refused HELLO handle this the same way."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(Op.HELLO, status, status_name(status), f"staging handshake: {message}")


def handshake(path: str, kind: str, nbytes: int = 0, fd: int | None = None,
              timeout_s: float = 10.0, version: int = PROTOCOL_VERSION) -> tuple[bytes, float]:
    """``(ticket, expires_s)`` for staging of ``kind``; raises ``HandshakeError`` when refused,
    ``DaemonUnavailable`` when the socket cannot be reached or does not answer in time.
    ``version``: another protocol's handshake (benchmarks driving an older daemon)."""
    message = msgpack.packb({"v": version, "kind": kind, "nbytes": int(nbytes)},
                            use_bin_type=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        try:
            connect(sock, path, timeout_s)
            if fd is None:
                sock.sendall(message)
            else:
                sent = socket.send_fds(sock, [message], [fd])
                if sent < len(message):
                    sock.sendall(message[sent:])
            answer = _read_reply(sock)
        except OSError as exc:  # socket.timeout included
            raise DaemonUnavailable(f"staging handshake at {path} failed: "
                                    f"{exc.strerror or exc}") from None
    finally:
        sock.close()
    if answer.get("status") != Status.OK:
        raise HandshakeError(answer.get("status", -1), str(answer.get("message", "")))
    return answer["ticket"], float(answer.get("expires_s", 0.0))


def connect(sock: socket.socket, path: str, timeout_s: float) -> None:
    """Connect, waiting up to ``timeout_s`` while the daemon's accept queue is full (a
    non-blocking Unix connect would fail with EAGAIN at once instead of waiting), then arm
    ``timeout_s`` for the rest of the exchange."""
    seconds = int(timeout_s)
    micros = int((timeout_s - seconds) * 1e6)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", seconds, micros))
    sock.connect(path)
    sock.settimeout(timeout_s)


def _read_reply(sock: socket.socket) -> dict[str, Any]:
    data = bytearray()
    while len(data) <= MAX_HANDSHAKE_BYTES:
        chunk = sock.recv(MAX_HANDSHAKE_BYTES)
        if not chunk:
            break
        data += chunk
    try:
        answer = msgpack.unpackb(bytes(data), raw=False)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise HandshakeError(Status.BAD_MESSAGE, f"unreadable handshake reply: {exc}") from None
    if not isinstance(answer, dict):
        raise HandshakeError(Status.BAD_MESSAGE, f"handshake reply is a {type(answer).__name__}")
    return answer


def inline_staging(transport: Any, timeout_s: float) -> dict:
    """HELLO's ``staging`` for a session without shared memory: with a ticket carrying our
    credentials when the daemon's handshake socket is on this host, without one otherwise (a
    remote TCP client: the daemon then knows it only by its token)."""
    path = handshake_path(transport)
    if not os.path.exists(path):
        return {"kind": "inline"}
    ticket, _ = handshake(path, "inline", 0, None, timeout_s)
    return {"kind": "inline", "ticket": ticket}


def handshake_path(transport: Any) -> str:
    """The daemon's handshake socket, from its PING reply."""
    header, _ = transport.call(Op.PING)
    path = header.get("handshake")
    if not isinstance(path, str) or not path:
        raise HandshakeError(Status.BAD_MESSAGE, f"PING reply names no handshake socket "
                             f"({path!r:.60}); is the daemon older than protocol 2?")
    return path
