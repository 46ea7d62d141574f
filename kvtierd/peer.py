"""Who is on the other end of a session, as the kernel says (SO_PEERCRED), never as the client says.

The staging handshake (a Unix socket beside the ZeroMQ socket) reads these credentials from the
connected socket and hands them to the session its one-time ticket opens. A session without a
handshake (an inline client over TCP) has no ``Peer``: its tenant can only come from its token.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Peer:
    uid: int  # effective user id of the connecting process
    gid: int  # effective group id of the connecting process
    pid: int  # process id at connect time (informational: pids are reused)

    def describe(self) -> str:
        return f"uid {self.uid} gid {self.gid} pid {self.pid}"
