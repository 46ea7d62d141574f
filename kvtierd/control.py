"""A one-shot request to a running daemon, for the CLI (stats, ping) and health checks."""

from __future__ import annotations

import itertools
import time
from typing import Any

import zmq

from kvtierd.protocol import Op, Status, pack, request, unpack

_ids = itertools.count(1)


class DaemonUnavailable(RuntimeError):
    pass


def call(address: str, op: Op, timeout_s: float = 5.0, token: str = "", **fields: Any
         ) -> dict[str, Any]:
    """Send one request and return the reply header; raise DaemonUnavailable on timeout.

    ``token``: the daemon's ``admin_token`` or ``auth_token``, which STATS and CHECK need once
    the daemon has one (sent only when given)."""
    if token:
        fields["token"] = token
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(address)
        request_id = next(_ids)
        sock.send(pack(request(op, request_id, **fields)))
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000)):
                raise DaemonUnavailable(f"no answer from {address} within {timeout_s:g} s")
            header = unpack(sock.recv_multipart()[0], 64 * 1024**2)
            if header.get("id") == request_id:
                if header.get("status") != Status.OK:
                    raise RuntimeError(f"{op.name} failed: {header.get('name')}: "
                                       f"{header.get('message')}")
                return header
    finally:
        sock.close(linger=0)
