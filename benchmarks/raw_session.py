"""A raw benchmark client: one DEALER and one filled shm staging buffer — what KVTierClient does,
without the KV-cache copies, so that a benchmark times the daemon alone. Shared by the benchmarks
(run as scripts, so this file sits beside them on ``sys.path``)."""

from __future__ import annotations

import mmap
import os
import secrets

import msgpack
import zmq

from kvtierd.protocol import PROTOCOL_VERSION, Op


class Session:
    """A raw DEALER with its own shm staging buffer (KVTierClient without the KV copies)."""

    def __init__(self, address: str, nbytes: int, namespace: str = "bench",
                 fingerprint: str = "bench") -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.name = f"kvtier-stg-bench-{secrets.token_hex(6)}"
        path = f"/dev/shm/{self.name}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self.buf = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fd)
        self.buf[:] = os.urandom(nbytes)
        self.next_id = 1
        try:
            self.call(Op.HELLO, namespace=namespace, rank=0, world_size=1, fingerprint=fingerprint,
                      staging={"kind": "shm", "name": self.name, "nbytes": nbytes})
        finally:
            os.unlink(path)

    def call(self, op: Op, **fields) -> dict:
        self.next_id += 1
        self.sock.send(msgpack.packb({"v": PROTOCOL_VERSION, "op": int(op), "id": self.next_id,
                                      **fields}))
        while True:
            header = msgpack.unpackb(self.sock.recv_multipart()[0])
            if header["id"] == self.next_id:
                if header["status"] != 0:
                    raise RuntimeError(f"{op.name}: {header['name']}: {header['message']}")
                return header

    def close(self) -> None:
        try:
            self.call(Op.BYE)
        finally:
            self.sock.close(linger=0)
            self.buf.close()
