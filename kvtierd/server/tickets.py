"""One-time staging tickets: what a handshake proved, waiting for the HELLO that presents it.

The handshake thread ``issue``s a ticket (random ``TICKET_BYTES``) for the peer's credentials, the
kind and, for ``memfd``, the verified mapping; the loop thread ``take``s it in HELLO. A ticket is
taken at most once (reused, it is unknown), is bound to its kind, and expires after ``ttl_s``: an
expired ticket's mapping is closed by ``expire``. At most ``max_tickets`` are outstanding, and
``max_per_uid`` of one user, so a client that handshakes without ever saying HELLO can neither pin
mappings in the daemon without bound nor lock other users out. The two threads
share the book under one lock; nothing slow runs under it.
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

from kvtierd.peer import Peer
from kvtierd.protocol import TICKET_BYTES, ProtocolError, Status


@dataclass(frozen=True)
class Ticket:
    kind: str  # the handshake's kind: memfd, cuda_ipc or inline
    peer: Peer  # SO_PEERCRED of the handshake connection
    nbytes: int  # announced staging size (0 for inline)
    staging: Any  # MemfdStaging for memfd (mapped, verified); None otherwise
    expires_at: float  # time.monotonic() deadline


class TicketBook:
    def __init__(self, ttl_s: float, max_tickets: int, max_per_uid: int | None = None) -> None:
        self.ttl_s = ttl_s
        self.max_tickets = max_tickets
        # one user cannot hold every ticket (and lock others out of the handshake) for ttl_s
        self.max_per_uid = max_per_uid or max(1, max_tickets // 4)
        self._lock = threading.Lock()
        self._tickets: dict[bytes, Ticket] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._tickets)

    def issue(self, kind: str, peer: Peer, nbytes: int, staging: Any = None) -> bytes:
        """A new ticket for a verified handshake; BUSY when too many are outstanding."""
        self.expire()
        ticket = secrets.token_bytes(TICKET_BYTES)
        with self._lock:
            if len(self._tickets) >= self.max_tickets:
                raise ProtocolError(Status.BUSY, f"{len(self._tickets)} handshakes await their "
                                    f"HELLO (the limit is {self.max_tickets}); retry shortly")
            mine = sum(1 for t in self._tickets.values() if t.peer.uid == peer.uid)
            if mine >= self.max_per_uid:
                raise ProtocolError(Status.BUSY, f"{mine} handshakes of uid {peer.uid} await "
                                    f"their HELLO (the limit per user is {self.max_per_uid}); "
                                    "say HELLO with them or let them expire")
            self._tickets[ticket] = Ticket(kind, peer, nbytes, staging,
                                           time.monotonic() + self.ttl_s)
        return ticket

    def take(self, ticket: object, kind: str) -> Ticket:
        """Consume ``ticket`` for a HELLO of ``kind``, or raise BAD_HANDLE saying why not.

        A ticket of another kind is consumed too (and its mapping closed): a client that mixes
        kinds up must handshake again, and a guessed ticket gives nothing to retry against.
        """
        if not isinstance(ticket, bytes) or len(ticket) != TICKET_BYTES:
            raise ProtocolError(Status.BAD_HANDLE, f"staging ticket {ticket!r:.60} must be the "
                                f"{TICKET_BYTES} bytes a staging handshake returned")
        with self._lock:
            found = next((t for t in self._tickets if hmac.compare_digest(t, ticket)), None)
            entry = self._tickets.pop(found) if found is not None else None
        if entry is None:
            raise ProtocolError(Status.BAD_HANDLE, "staging ticket is unknown: already used, "
                                "expired or never issued; do the staging handshake again")
        if entry.expires_at <= time.monotonic():
            _close(entry)
            raise ProtocolError(Status.BAD_HANDLE, f"staging ticket expired ({self.ttl_s:g} s "
                                "after its handshake); do the handshake again")
        if entry.kind != kind:
            _close(entry)
            raise ProtocolError(Status.BAD_HANDLE, f"staging ticket was issued for kind "
                                f"{entry.kind!r}, HELLO asks for {kind!r}; allowed: the kind "
                                "of its handshake")
        return entry

    def expire(self, now: float | None = None) -> int:
        """Drop expired tickets, closing their mappings; return how many were dropped."""
        now = time.monotonic() if now is None else now
        with self._lock:
            dead = [t for t, entry in self._tickets.items() if entry.expires_at <= now]
            entries = [self._tickets.pop(t) for t in dead]
        for entry in entries:
            _close(entry)
        return len(entries)

    def close_all(self) -> None:
        with self._lock:
            entries = list(self._tickets.values())
            self._tickets.clear()
        for entry in entries:
            _close(entry)


def _close(entry: Ticket) -> None:
    if entry.staging is not None:
        entry.staging.close()
