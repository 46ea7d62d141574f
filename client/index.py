"""``KVTierIndex``: a session that only asks the daemon about keys, for engine schedulers.

A scheduler decides which chunks to load or store but never touches KV bytes, so it needs no
staging buffer and no KV tensors: it greets the daemon with an ``inline`` staging (nothing mapped;
an inline handshake's ticket gives it the same credentials as the workers) under the namespace, rank and fingerprint of the worker whose chunks it asks about, then sends
LOOKUP batches. Keys are opaque bytes (an engine's own chunk keys), not planned ``Chunk`` objects.

It runs on the caller's thread with a short timeout and never raises for an absent daemon: after a
failure it answers "miss" for ``retry_s`` without trying (a scheduler step must not wait on a daemon
that is down), then greets it again. A daemon that forgot the session (restart, silence longer than
its session timeout) is greeted again at once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence

from kvtierd.protocol import Op, Status, Tier

from .handshake import HandshakeError, inline_staging
from .transport import DaemonError, DaemonUnavailable, Transport

log = logging.getLogger(__name__)


class KVTierIndex:
    def __init__(self, address: str, *, namespace: str, rank: int, fingerprint: str,
                 world_size: int = 1, timeout_s: float = 2.0, retry_s: float = 5.0,
                 token: str = "") -> None:
        if timeout_s <= 0 or retry_s < 0:
            raise ValueError(f"timeout_s={timeout_s}, retry_s={retry_s}; allowed: timeout_s > 0, "
                             "retry_s >= 0")
        self.address = address
        self.namespace = namespace
        self.rank = rank
        self.world_size = world_size  # HELLO checks 0 <= rank < world_size
        self.fingerprint = fingerprint
        self.retry_s = retry_s
        self._token = token
        self._transport = Transport(address, timeout_s)
        self._lock = threading.Lock()  # one request at a time on the socket
        self._session: int | None = None
        self._max_batch = 1024
        self._down_until = 0.0
        self.failures = 0  # daemon calls that timed out or were refused (a counter for metrics)

    @property
    def available(self) -> bool:
        """False while backing off after a failure (calls answer misses without asking)."""
        return time.monotonic() >= self._down_until

    def lookup(self, keys: Sequence[bytes], lease: bool = False) -> list[Tier]:
        """Tier of each key (``Tier.NONE`` = miss); all misses while the daemon is unavailable.

        ``lease=True`` protects the hits from eviction for the daemon's ``lease_timeout_s``.
        """
        keys = list(keys)
        out: list[Tier] = []
        with self._lock:
            for i in range(0, len(keys), self._max_batch):
                header = self._call(Op.LOOKUP, keys=keys[i:i + self._max_batch], lease=lease)
                if header is None:
                    return [Tier.NONE] * len(keys)
                out.extend(Tier(t) if t in Tier._value2member_map_ else Tier.NONE
                           for t in header["tiers"])
        return out

    def close(self) -> None:
        with self._lock:
            if self._session is not None and self.available:
                try:
                    self._transport.call(Op.BYE)
                except (DaemonUnavailable, DaemonError) as exc:
                    log.debug("BYE not answered: %s", exc)
            self._session = None
            self._transport.close()

    # -- caller's thread, under the lock ---------------------------------------------------------
    def _call(self, op: Op, **fields) -> dict | None:
        if not self.available:
            return None
        try:
            for attempt in (0, 1):
                self._ensure_session()
                try:
                    return self._transport.call(op, **fields)[0]
                except DaemonError as exc:
                    if exc.status != Status.NO_SESSION or attempt:
                        raise
                    self._session = None  # the daemon restarted or reaped us: greet it again
        except (DaemonUnavailable, DaemonError, HandshakeError) as exc:
            self.failures += 1
            self._down_until = time.monotonic() + self.retry_s
            self._session = None
            self._transport.reset()
            log.warning("kvtierd at %s unavailable, answering misses for %g s: %s",
                        self.address, self.retry_s, exc)
        return None

    def _ensure_session(self) -> None:
        if self._session is not None:
            return
        staging = inline_staging(self._transport, self._transport.timeout_s)  # our credentials
        header, _ = self._transport.call(
            Op.HELLO, namespace=self.namespace, rank=self.rank, world_size=self.world_size,
            fingerprint=self.fingerprint,
            staging=staging, token=self._token,
            client={"pid": os.getpid(), "library": "kvtier_client.index"})
        self._session = header["session"]
        self._max_batch = int(header.get("limits", {}).get("max_batch", self._max_batch))
