"""Client sessions: who may address which keys, through which staging buffer, until when.

A session starts with HELLO and ends with BYE, a ZeroMQ disconnect of its peer, or silence longer
than ``session_timeout_s``. It is found by its peer's routing id *and* the ``secret`` its HELLO
reply gave (``get``): libzmq lets any peer claim any routing id, so a process that reconnects with
the id of a connection that closed without BYE must not inherit that session. Ending it aborts its PENDING reservations and releases its leases, so a
``kill -9`` of a worker leaks nothing. Its staging buffer is unmapped once no copy uses it any more.
"""

from __future__ import annotations

import hmac
import itertools
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Hashable

from kvtierd.peer import Peer
from kvtierd.protocol import SECRET_BYTES
from kvtierd.staging import MemfdStaging
from kvtierd.tiers.chunk import ChunkEntry
from kvtierd.tiers.cpu import CpuTier

log = logging.getLogger(__name__)

_ids = itertools.count(1)


@dataclass(eq=False)
class Session:
    identity: bytes  # ZeroMQ routing id of the peer
    tenant: str  # assigned by the daemon (kvtierd.tenants), never chosen by the client
    namespace: str
    rank: int
    world_size: int
    fingerprint: str
    staging: MemfdStaging | Any | None  # MemfdStaging, CudaIpcStaging; None: inline frames
    client: dict
    # Kernel-reported credentials from the staging handshake; None without one (inline over TCP).
    peer: Peer | None = None
    id: int = field(default_factory=lambda: next(_ids))
    # Every request of the session carries it (protocol 3); only HELLO's reply says it.
    secret: bytes = field(default_factory=lambda: secrets.token_bytes(SECRET_BYTES), repr=False)
    last_seen: float = field(default_factory=time.monotonic)
    # ikey -> (leased entry, expiry on the monotonic clock)
    leases: dict[Hashable, tuple[ChunkEntry, float]] = field(default_factory=dict)
    in_flight: int = 0  # copy jobs that still use the staging buffer
    closed: bool = False
    batches_in_flight: int = 0  # PUT/GET batches answered later (max_in_flight_requests)
    # Inline GET replies still held by the daemon or libzmq: (tracker, bytes); their sum is
    # inline_reply_bytes (max_inline_reply_bytes bounds it).
    inline_replies: list[tuple[Any, int]] = field(default_factory=list)
    inline_reply_bytes: int = 0

    def release_sent_replies(self) -> None:
        """Forget inline replies that libzmq has finished sending (or dropped)."""
        held = []
        for tracker, nbytes in self.inline_replies:
            if tracker is None or tracker.done:
                self.inline_reply_bytes -= nbytes
            else:
                held.append((tracker, nbytes))
        self.inline_replies = held

    @property
    def space(self) -> tuple[str, str, int]:
        """The key space this session addresses: its tenant's, never another's."""
        return (self.tenant, self.namespace, self.rank)

    def ikey(self, key: bytes) -> tuple[tuple[str, str, int], bytes]:
        return (self.space, key)


class SessionTable:
    def __init__(self, tier: CpuTier, timeout_s: float, lease_timeout_s: float,
                 lower: Any = None) -> None:
        """``lower``: the tiers below the CPU tier, whose chunks a LOOKUP may lease too;
        a lease is pinned and unpinned in the tier whose index holds its entry."""
        self.tier = tier
        self.lower = lower
        self.timeout_s = timeout_s
        self.lease_timeout_s = lease_timeout_s
        self.by_identity: dict[bytes, Session] = {}

    def __len__(self) -> int:
        return len(self.by_identity)

    def get(self, identity: bytes, secret: object) -> Session | None:
        """The session of ``identity`` when ``secret`` is its secret (compared in constant time),
        which also counts as its heartbeat; None otherwise (no session, or a request that is not
        the session's own)."""
        session = self.by_identity.get(identity)
        if session is None or not isinstance(secret, bytes) or not hmac.compare_digest(
                session.secret, secret):
            return None
        session.last_seen = time.monotonic()
        return session

    def count_of_uid(self, uid: int | None, excluding: bytes = b"") -> int:
        """Sessions whose peer has ``uid`` (None: sessions without credentials), the one of
        routing id ``excluding`` aside."""
        return sum(1 for identity, s in self.by_identity.items() if identity != excluding
                   and (s.peer.uid if s.peer is not None else None) == uid)

    def add(self, session: Session) -> None:
        old = self.by_identity.get(session.identity)
        if old is not None:
            self.close(old, "rehello")
        self.by_identity[session.identity] = session

    # -- leases ----------------------------------------------------------------------------------
    def lease(self, session: Session, entry: ChunkEntry) -> None:
        """Pin ``entry`` for the session until its GET or ``lease_timeout_s``. A lease taken again
        is re-inserted last: every lease has the same timeout and the clock only moves forward,
        so a session's leases stay in expiry order and ``expire`` stops at the first live one."""
        expiry = time.monotonic() + self.lease_timeout_s
        held = session.leases.pop(entry.ikey, None)
        if held is None or held[0] is not entry:
            if held is not None:
                self._unpin(held[0])
            self._tier_of(entry).pin(entry)
        session.leases[entry.ikey] = (entry, expiry)

    def _tier_of(self, entry: ChunkEntry) -> Any:
        # A tier without a compact index (the remote one) keeps no slots: its entries' pins are
        # plain counts, which the CPU tier's pin/unpin keep as well (slot -1: nothing to fold).
        for tier in self.lower or ():
            holds = getattr(getattr(tier, "index", None), "holds", None)
            if holds is not None and holds(entry):
                return tier
        return self.tier

    def _unpin(self, entry: ChunkEntry) -> None:
        self._tier_of(entry).unpin(entry)

    def release_lease(self, session: Session, ikey: Hashable) -> None:
        held = session.leases.pop(ikey, None)
        if held is not None:
            self._unpin(held[0])

    # -- ending ----------------------------------------------------------------------------------
    def close(self, session: Session, reason: str) -> None:
        """End ``session``: drop its leases; its in-flight reservations abort on completion."""
        if session.closed:
            return
        session.closed = True
        if self.by_identity.get(session.identity) is session:
            del self.by_identity[session.identity]
        for entry, _ in session.leases.values():
            self._unpin(entry)
        session.leases.clear()
        # Every reservation has its copy in flight (reserve and submit happen together); the loop
        # aborts it when that copy completes and sees the session closed.
        self.release_staging(session)
        log.info("session %d (tenant %s, %s rank %d) closed: %s", session.id, session.tenant,
                 session.namespace, session.rank, reason)

    def release_staging(self, session: Session) -> None:
        if session.closed and session.in_flight == 0 and session.staging is not None:
            session.staging.close()

    def expire(self, now: float | None = None) -> list[Session]:
        """Close silent sessions and drop expired leases; return the sessions closed."""
        now = time.monotonic() if now is None else now
        dead = [s for s in self.by_identity.values() if now - s.last_seen > self.timeout_s]
        for session in dead:
            self.close(session, "heartbeat timeout")
        for session in self.by_identity.values():
            # Expiry order (``lease``): only the expired ones and one live lease are looked at,
            # not every lease every tick (1024-key leased LOOKUPs: ~10 % of the loop's time).
            expired = []
            for ikey, (_, expiry) in session.leases.items():
                if expiry > now:
                    break
                expired.append(ikey)
            for ikey in expired:
                self.release_lease(session, ikey)
        return dead

    def check_invariants(self) -> None:
        pins: dict[int, int] = {}
        for identity, session in self.by_identity.items():
            assert session.identity == identity and not session.closed, "stale session in table"
            assert session.in_flight >= 0, f"session {session.id} in_flight < 0"
            expiries = [expiry for _, expiry in session.leases.values()]
            assert expiries == sorted(expiries), f"session {session.id}: leases out of order"
            for ikey, (entry, _) in session.leases.items():
                assert entry.ikey == ikey, "lease recorded under another key"
                pins[id(entry)] = pins.get(id(entry), 0) + 1
        # A pinned chunk is always in its index's active form, so only those need a look.
        tiers = [self.tier, *(t for t in self.lower or () if hasattr(getattr(t, "index", None), "active"))]
        for tier in tiers:
            for entry in list(tier.index.active.values()):
                assert entry.pin_count == pins.get(id(entry), 0), (
                    f"chunk {entry.ikey!r} has pin_count {entry.pin_count}, "
                    f"but {pins.get(id(entry), 0)} live lease(s)")

    def close_all(self, reason: str) -> None:
        for session in list(self.by_identity.values()):
            self.close(session, reason)
