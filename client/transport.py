"""Request/reply over one ZeroMQ DEALER socket, for one thread.

Replies are matched by request id; anything else (the daemon's ``id: 0`` liveness probes, replies
to requests that already timed out) is skipped. A timeout leaves the socket in an unknown state (the
daemon may still act on the request later), so the caller must ``reset`` and start a new session.
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

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.address)
            self._sock = sock
        return self._sock

    def call(self, op: Op, frames: list | None = None, **fields: Any) -> tuple[dict, list]:
        """Send one request; return the reply header (status OK) and its payload frames."""
        sock = self._socket()
        request_id = next(self._ids)
        sock.send_multipart([pack(request(op, request_id, **fields)), *(frames or [])],
                            copy=not frames)
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(max(1, int(left * 1000))):
                raise DaemonUnavailable(
                    f"{op.name}: no answer from kvtierd at {self.address} within "
                    f"{self.timeout_s:g} s")
            parts = sock.recv_multipart(copy=False)
            try:
                header = unpack(parts[0].bytes, MAX_REPLY_HEADER)
            except ProtocolError:
                continue
            if header.get("id") != request_id:
                continue
            if header.get("status") != Status.OK:
                raise DaemonError(op, header.get("status"), header.get("name", "?"),
                                  header.get("message", ""))
            return header, [p.buffer for p in parts[1:]]

    def reset(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def close(self) -> None:
        self.reset()
