"""systemd's service notification protocol (``sd_notify``), in a few lines of our own.

A ``Type=notify`` unit hands the daemon ``$NOTIFY_SOCKET``: a unix datagram socket, given as a path
or, with a leading ``@``, as an abstract name. Each notification is one datagram of ``KEY=VALUE``
lines. The daemon sends:

* ``STATUS=...`` while it starts (mapping the arena, recovering an index) — ``systemctl status``
  shows the last one;
* ``READY=1`` (with a final ``STATUS=``) once it serves requests: systemd starts units ordered after
  it only then;
* ``WATCHDOG=1`` from the request loop, at half of ``$WATCHDOG_USEC`` (``WatchdogSec=``), so that a
  wedged loop gets the unit restarted;
* ``STOPPING=1`` first thing on shutdown.

Without ``$NOTIFY_SOCKET`` every call is a no-op. A send that fails is logged once and never raises:
the daemon's job is to serve, not to be supervised.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Mapping

log = logging.getLogger(__name__)


class Notifier:
    def __init__(self, address: str | None, watchdog_usec: int = 0) -> None:
        # An abstract socket name starts with a NUL byte on the wire; systemd writes it as '@'.
        self.address = "\0" + address[1:] if address and address.startswith("@") else address
        # systemd asks for a ping at least every WatchdogSec; half leaves room for a slow tick.
        self.watchdog_interval_s = watchdog_usec / 2e6 if watchdog_usec > 0 else 0.0
        self._next_watchdog = 0.0
        self._sock: socket.socket | None = None
        self._warned = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> "Notifier":
        env = os.environ if env is None else env
        address = env.get("NOTIFY_SOCKET") or None
        watchdog_usec = _int(env.get("WATCHDOG_USEC"))
        watchdog_pid = _int(env.get("WATCHDOG_PID"))
        if watchdog_pid and watchdog_pid != os.getpid():
            watchdog_usec = 0  # the watchdog was meant for another process (e.g. a wrapper)
        return cls(address, watchdog_usec)

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def send(self, *lines: str) -> bool:
        """Send one notification of ``KEY=VALUE`` lines; False if there is no socket or it failed."""
        if not self.address:
            return False
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto("\n".join(lines).encode(), self.address)
            return True
        except OSError as exc:
            if not self._warned:
                log.warning("cannot notify systemd at %r: %s", self.address.lstrip("\0"), exc)
                self._warned = True
            return False

    def status(self, text: str) -> bool:
        return self.send(f"STATUS={_one_line(text)}")

    def ready(self, status: str) -> bool:
        self._next_watchdog = 0.0
        return self.send("READY=1", f"STATUS={_one_line(status)}")

    def watchdog(self, now: float | None = None) -> bool:
        """Ping the watchdog if it is enabled and half its interval has passed since the last."""
        if not self.watchdog_interval_s or not self.address:
            return False
        now = time.monotonic() if now is None else now
        if now < self._next_watchdog:
            return False
        self._next_watchdog = now + self.watchdog_interval_s
        return self.send("WATCHDOG=1")

    def stopping(self, status: str = "stopping") -> bool:
        return self.send("STOPPING=1", f"STATUS={_one_line(status)}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _int(text: str | None) -> int:
    try:
        return int(text) if text else 0
    except ValueError:
        return 0


def _one_line(text: str) -> str:
    return " ".join(text.split())
