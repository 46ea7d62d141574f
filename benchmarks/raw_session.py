"""A raw benchmark client: one DEALER and one filled memfd staging buffer (handed over by the
staging handshake) — what KVTierClient does, without the KV-cache copies, so that a benchmark times
the daemon alone. Shared by the benchmarks (run as scripts, so this file sits beside them on
``sys.path``).

``ShmSession`` speaks protocol 1 (staging named by a /dev/shm file in HELLO), so that a benchmark
can drive a checkout from before the memfd handshake (e.g. the code issue 12 was measured on) in
the same run as this one, and ``Protocol2Session`` protocol 2 (the memfd handshake without
session secrets, before 7 December 2026); ``session_for`` picks the session a checkout's daemon
speaks."""

from __future__ import annotations

import mmap
import os
import re
import uuid
from pathlib import Path

import msgpack
import torch
import zmq

from kvtier_client.handshake import handshake
from kvtier_client.staging import MemfdStagingBuffer
from kvtierd.protocol import PROTOCOL_VERSION, Op


class Session:
    """A raw DEALER with its own memfd staging buffer (KVTierClient without the KV copies)."""

    version = PROTOCOL_VERSION  # of the requests' headers

    def __init__(self, address: str, nbytes: int, namespace: str = "bench",
                 fingerprint: str = "bench") -> None:
        self._connect(address)
        self.staging = MemfdStagingBuffer(nbytes)
        self.staging.tensor.copy_(torch.frombuffer(bytearray(os.urandom(nbytes)),
                                                   dtype=torch.uint8))
        try:
            ticket, _ = handshake(self.call(Op.PING)["handshake"], "memfd", nbytes,
                                  self.staging.fd, version=self.version)
        finally:
            self.staging.release_fd()
        self.call(Op.HELLO, namespace=namespace, rank=0, world_size=1, fingerprint=fingerprint,
                  staging=self.staging.handle(ticket))

    def _connect(self, address: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.next_id = 1
        self.secret: bytes | None = None  # protocol 3: the session's, from HELLO

    def call(self, op: Op, **fields) -> dict:
        self.next_id += 1
        if self.secret is not None and op is not Op.HELLO:
            fields["secret"] = self.secret
        self.sock.send(msgpack.packb({"v": self.version, "op": int(op), "id": self.next_id,
                                      **fields}))
        while True:
            header = msgpack.unpackb(self.sock.recv_multipart()[0])
            if header["id"] == self.next_id:
                if header["status"] != 0:
                    raise RuntimeError(f"{op.name}: {header['name']}: {header['message']}")
                if op is Op.HELLO and self.version >= 3:
                    self.secret = header["secret"]
                return header

    def close(self) -> None:
        try:
            self.call(Op.BYE)
        finally:
            self.sock.close(linger=0)
            self._close_staging()

    def _close_staging(self) -> None:
        self.staging.close()


class Protocol2Session(Session):
    """Protocol 2's raw session: the same memfd handshake, no session secret (a protocol-2 daemon
    accepts a memfd sealed SHRINK | GROW, as protocol 3's client seals it)."""

    version = 2


class ShmSession(Session):
    """Protocol 1's raw session: the staging buffer is a /dev/shm file named in HELLO (the daemon
    maps it; the file is unlinked once HELLO is answered, as that protocol's client did)."""

    version = 1

    def __init__(self, address: str, nbytes: int, namespace: str = "bench",
                 fingerprint: str = "bench") -> None:
        self._connect(address)
        name = f"kvtier-stg-bench-{uuid.uuid4().hex}"
        path = Path("/dev/shm") / name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self._map = mmap.mmap(fd, nbytes)
            self._map[:] = os.urandom(nbytes)
            self.call(Op.HELLO, namespace=namespace, rank=0, fingerprint=fingerprint,
                      staging={"kind": "shm", "name": name, "nbytes": nbytes})
        finally:
            os.close(fd)
            path.unlink(missing_ok=True)

    def _close_staging(self) -> None:
        self._map.close()


def protocol_of(code_dir: Path) -> int:
    """The protocol version the kvtierd checkout in ``code_dir`` speaks (its protocol module)."""
    text = (Path(code_dir) / "kvtierd" / "protocol.py").read_text()
    found = re.search(r"^PROTOCOL_VERSION = (\d+)$", text, re.MULTILINE)
    if found is None:
        raise RuntimeError(f"{code_dir}: no PROTOCOL_VERSION in kvtierd/protocol.py")
    return int(found.group(1))


def session_for(code_dir: Path, address: str, nbytes: int) -> Session:
    """A raw session of the protocol the daemon of ``code_dir`` speaks: this one's, or 1."""
    version = protocol_of(code_dir)
    if version == PROTOCOL_VERSION:
        return Session(address, nbytes)
    if version == 2:
        return Protocol2Session(address, nbytes)
    if version == 1:
        return ShmSession(address, nbytes)
    raise RuntimeError(f"{code_dir} speaks protocol {version}: this benchmark speaks "
                       f"{PROTOCOL_VERSION}, 2 and 1")
