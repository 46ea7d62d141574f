"""Who may ask what, and how much: the refusals that keep one peer from exhausting the daemon.

* Admin ops (STATS, CHECK: O(chunks) on the loop thread) need a token once one is configured:
  the ``token`` field of their header matching ``auth_token`` or ``admin_token``, or a session
  that presented ``auth_token`` in its HELLO. PING always answers (liveness probes).
* ``max_sessions``: a HELLO that would open one session too many is answered BUSY (a re-HELLO of
  an existing session replaces it and is always allowed).
* ``max_in_flight_requests``: a PUT or GET while the session already has that many batches waiting
  for copies is answered BUSY; the client retries once an earlier one is answered.

Every refusal names the limit and is counted in ``kvtierd_refused_total{reason}``.
"""

from __future__ import annotations

import hmac
from typing import Any

from kvtierd.config import Config
from kvtierd.metrics import DaemonMetrics
from kvtierd.protocol import Op, ProtocolError, Status
from kvtierd.server.sessions import Session, SessionTable

ADMIN_OPS = frozenset({Op.STATS, Op.CHECK})


def holds_admin_token(cfg: Config, session: Session | None, header: dict) -> bool:
    """The request may see what only the operator may (per-tenant figures): its ``token`` is
    ``admin_token`` or ``auth_token``, or its session opened with ``auth_token``."""
    if cfg.auth_token and session is not None:
        return True
    token = header.get("token")
    return token_matches(token, cfg.auth_token) or token_matches(token, cfg.admin_token)


def token_matches(given: Any, expected: str) -> bool:
    """Constant-time comparison of a header's token with a configured one (never empty)."""
    if not expected or not isinstance(given, str):
        return False
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), expected.encode("utf-8"))


class Admission:
    def __init__(self, cfg: Config, metrics: DaemonMetrics, max_sessions: int) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.max_sessions = max_sessions  # cfg.max_sessions, or lower to fit RLIMIT_NOFILE

    def refuse(self, reason: str, status: Status, message: str) -> ProtocolError:
        self.metrics.refused.labels(reason).inc()
        return ProtocolError(status, message)

    def check_admin(self, op: Op, session: Session | None, header: dict) -> None:
        if op not in ADMIN_OPS or not (self.cfg.auth_token or self.cfg.admin_token):
            return
        if holds_admin_token(self.cfg, session, header):
            return
        raise self.refuse("auth", Status.AUTH_FAILED,
                          f"{op.name} needs a token: a 'token' field holding auth_token or "
                          "admin_token, or a session opened with auth_token")

    def check_hello(self, sessions: SessionTable, identity: bytes) -> None:
        if identity in sessions.by_identity or len(sessions) < self.max_sessions:
            return
        raise self.refuse("sessions", Status.BUSY,
                          f"the daemon has {len(sessions)} sessions, max_sessions is "
                          f"{self.max_sessions}; retry later")

    def check_batch(self, op: Op, session: Session) -> None:
        if session.batches_in_flight < self.cfg.max_in_flight_requests:
            return
        raise self.refuse("in_flight", Status.BUSY,
                          f"{op.name} refused: this session has {session.batches_in_flight} "
                          f"requests in flight, max_in_flight_requests is "
                          f"{self.cfg.max_in_flight_requests}; wait for their replies")
