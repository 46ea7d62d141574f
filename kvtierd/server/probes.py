"""When the loop probes its sessions' peers after ZeroMQ disconnects: coalesced and rate-limited.

A probe is an ``id: 0`` notice sent under ROUTER_MANDATORY: a peer that is gone answers
EHOSTUNREACH at once and its session is closed. The monitor says *that* a peer left, not which
one, so a round probes every session. Once this was a round per disconnect event (three, as pipes
close late): 20,000 connect/close cycles queued 60,000 notices for an idle session, its pipe hit
SNDHWM and its PING reply was dropped. Now:

* one round per ``PROBE_INTERVAL_S`` at most, however many disconnects arrived meanwhile;
* rounds go on every interval until one runs ``PROBE_WINDOW_S`` after the latest disconnect (a
  pipe can close a little after its disconnect event);
* a round skips sessions whose peer has sent something since the latest disconnect (it is there),
  so a busy session is not probed at all and an idle one gets at most 1 / ``PROBE_INTERVAL_S``
  notices per second, whatever the churn.
"""

from __future__ import annotations

import math
import threading

PROBE_INTERVAL_S = 0.2
PROBE_WINDOW_S = 1.0


class ProbeSchedule:
    """Disconnects are reported from the connection guard's thread; rounds run on the loop's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last_disconnect: float | None = None
        self._last_round = -math.inf
        self.rounds = 0

    def disconnected(self, when: float) -> None:
        with self._lock:
            if self._last_disconnect is None or when > self._last_disconnect:
                self._last_disconnect = when

    def due(self, now: float) -> float | None:
        """If a round is due now, mark it done and return the disconnect time it covers: sessions
        heard from after that time need no probe."""
        with self._lock:
            latest = self._last_disconnect
        if latest is None or now - self._last_round < PROBE_INTERVAL_S:
            return None
        if self._last_round > latest + PROBE_WINDOW_S:
            return None  # the last round already ran after the window of the latest disconnect
        self._last_round = now
        self.rounds += 1
        return latest
