"""Request/reply over one ZeroMQ DEALER socket, for one thread.

Replies are matched by request id; anything else (the daemon's ``id: 0`` liveness probes, replies
to requests that already timed out) is skipped. Several requests may be in flight (``send`` them,
then ``receive`` each by id): the daemon answers a batch when its copies finish, so replies can
come out of order, and one that arrives before it is asked for is kept until it is. A timeout
leaves the socket in an unknown state (the daemon may still act on the request later), so the
caller must ``reset`` and start a new session.

A session is bound to its HELLO's ``secret`` (protocol 3): the transport keeps the secret of the
last HELLO it was answered and sends it in every later request, until ``reset``.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import zmq

from kvtierd.protocol import Op, ProtocolError, Status, pack, request, unpack

MAX_REPLY_HEADER = 64 * 1024**2


class DaemonUnavailable(ConnectionError):
    """The daemon did not answer in time (down, restarting or overloaded)."""


class DaemonError(RuntimeError):
    """The daemon refused a request as a whole."""

    def __init__(self, op: Op, status: int, name: str, message: str) -> None:
        super().__init__(f"{op.name} refused: {name}: {message}")
        self.status = status
        self.name = name


class Transport:
    def __init__(self, address: str, timeout_s: float) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._ids = itertools.count(1)
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._waiting: set[int] = set()  # sent, not yet received
        self._early: dict[int, tuple[dict, list]] = {}  # replies that came before their receive
        self._secret: bytes | None = None  # the session's, from its HELLO reply

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.address)
            self._sock = sock
        return self._sock

    def call(self, op: Op, frames: list | None = None, **fields: Any) -> tuple[dict, list]:
        """Send one request; return the reply header (status OK) and its payload frames."""
        return self.receive(op, self.send(op, frames, **fields))

    def send(self, op: Op, frames: list | None = None, **fields: Any) -> int:
        """Send one request without waiting; return its id for ``receive``."""
        sock = self._socket()
        request_id = next(self._ids)
        if self._secret is not None and op is not Op.HELLO:
            fields["secret"] = self._secret
        sock.send_multipart([pack(request(op, request_id, **fields)), *(frames or [])],
                            copy=not frames)
        self._waiting.add(request_id)
        return request_id

    def receive(self, op: Op, request_id: int) -> tuple[dict, list]:
        """Wait up to ``timeout_s`` for the reply to ``request_id``; raise ``DaemonError`` if it
        is not OK. Replies to other requests still in flight are kept for their own ``receive``."""
        self._waiting.discard(request_id)
        parts = self._early.pop(request_id, None)
        deadline = time.monotonic() + self.timeout_s
        while parts is None:
            left = deadline - time.monotonic()
            sock = self._socket()
            if left <= 0 or not sock.poll(max(1, int(left * 1000))):
                raise DaemonUnavailable(
                    f"{op.name}: no answer from kvtierd at {self.address} within "
                    f"{self.timeout_s:g} s")
            got = sock.recv_multipart(copy=False)
            try:
                header = unpack(got[0].bytes, MAX_REPLY_HEADER)
            except ProtocolError:
                continue
            rid = header.get("id")
            if rid == request_id:
                parts = (header, got)
            elif rid in self._waiting:
                self._early[rid] = (header, got)
        header, got = parts
        if header.get("status") != Status.OK:
            raise DaemonError(op, header.get("status"), header.get("name", "?"),
                              header.get("message", ""))
        if op is Op.HELLO:
            secret = header.get("secret")
            self._secret = secret if isinstance(secret, bytes) else None
        return header, [p.buffer for p in got[1:]]

    def reset(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        self._waiting.clear()  # their replies went with the socket
        self._early.clear()
        self._secret = None  # the session went with the socket

    def close(self) -> None:
        self.reset()
