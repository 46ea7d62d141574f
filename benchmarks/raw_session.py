"""A raw benchmark client: one DEALER and one filled memfd staging buffer (handed over by the
staging handshake) — what KVTierClient does, without the KV-cache copies, so that a benchmark times
the daemon alone. Shared by the benchmarks (run as scripts, so this file sits beside them on
``sys.path``)."""

from __future__ import annotations

import os

import msgpack
import torch
import zmq

from kvtier_client.handshake import handshake
from kvtier_client.staging import MemfdStagingBuffer
from kvtierd.protocol import PROTOCOL_VERSION, Op


class Session:
    """A raw DEALER with its own memfd staging buffer (KVTierClient without the KV copies)."""

    def __init__(self, address: str, nbytes: int, namespace: str = "bench",
                 fingerprint: str = "bench") -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.staging = MemfdStagingBuffer(nbytes)
        self.staging.tensor.copy_(torch.frombuffer(bytearray(os.urandom(nbytes)),
                                                   dtype=torch.uint8))
        self.next_id = 1
        try:
            ticket, _ = handshake(self.call(Op.PING)["handshake"], "memfd", nbytes,
                                  self.staging.fd)
        finally:
            self.staging.release_fd()
        self.call(Op.HELLO, namespace=namespace, rank=0, world_size=1, fingerprint=fingerprint,
                  staging=self.staging.handle(ticket))

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
            self.staging.close()
