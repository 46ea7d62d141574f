"""A raw DEALER for protocol tests: sends whatever frames a test builds, returns the reply."""

from __future__ import annotations

import itertools
import time
from typing import Any

import msgpack
import zmq

from kvtierd.protocol import PROTOCOL_VERSION, Op


class RawClient:
    def __init__(self, address: str, timeout_s: float = 10.0) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.timeout_s = timeout_s
        self._ids = itertools.count(1)

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
        header = {"v": PROTOCOL_VERSION, "op": int(op), "id": next(self._ids), **fields}
        self.send_frames([msgpack.packb(header, use_bin_type=True), *(frames or [])])
        reply, payload = self.recv()
        assert reply["id"] == header["id"], reply
        return reply, payload

    def close(self) -> None:
        self.sock.close(linger=0)
