"""A raw DEALER for protocol tests: sends whatever frames a test builds, returns the reply.

``request`` keeps the ``secret`` of the last HELLO answered OK and adds it to every later request
(protocol 3), unless the request names its own ``secret`` (or ``secret=None``: none at all);
``send_frames`` sends exactly what it is given."""

from __future__ import annotations

import itertools
import time
from typing import Any

import msgpack
import zmq

from kvtierd.protocol import PROTOCOL_VERSION, Op


class RawClient:
    def __init__(self, address: str, timeout_s: float = 10.0, routing_id: bytes | None = None
                 ) -> None:
        self.address = address
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if routing_id is not None:  # a peer may claim any routing id (the takeover tests)
            self.sock.setsockopt(zmq.ROUTING_ID, routing_id)
        self.sock.connect(address)
        self.timeout_s = timeout_s
        self._ids = itertools.count(1)
        self.secret: bytes | None = None  # of the session the last OK HELLO opened

    def send_frames(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def recv(self) -> tuple[dict, list[bytes]]:
        """Next reply that is not a liveness probe (``id`` 0)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            assert left > 0 and self.sock.poll(int(left * 1000)), "no reply from the daemon"
            parts = self.sock.recv_multipart()
            header = msgpack.unpackb(parts[0], raw=False)
            if header.get("id") != 0:
                return header, parts[1:]

    def request(self, op: Op | int, frames: list[bytes] | None = None, **fields: Any
                ) -> tuple[dict, list[bytes]]:
        header = {"v": PROTOCOL_VERSION, "op": int(op), "id": next(self._ids)}
        if self.secret is not None and int(op) != Op.HELLO:
            header["secret"] = self.secret
        header.update(fields)
        if header.get("secret", b"") is None:
            del header["secret"]
        self.send_frames([msgpack.packb(header, use_bin_type=True), *(frames or [])])
        reply, payload = self.recv()
        assert reply["id"] == header["id"], reply
        if int(op) == Op.HELLO and reply.get("name") == "OK":
            self.secret = reply.get("secret")  # (None from a daemon before protocol 3)
        return reply, payload

    def close(self) -> None:
        self.sock.close(linger=0)
