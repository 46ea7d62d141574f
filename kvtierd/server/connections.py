"""Bounded client connections: EMFILE must never reach libzmq's ipc listener.

What aborted (libzmq 4.3.5, as bundled by pyzmq 27): with RLIMIT_NOFILE at 1024/1024, 1,100 idle
DEALER connections to the daemon's ``ipc://`` socket end it with ``Too many open files
(src/ipc_listener.cpp:297)`` and SIGABRT. ``ipc_listener_t::accept`` asserts that a failed
``accept4`` failed with EAGAIN, EINTR, ECONNABORTED, EPROTO or ENFILE; EMFILE is not in that list
(``tcp_listener_t::accept`` tolerates it and drops the connection). So the first ``accept4`` that
finds the descriptor table full kills the daemon, whatever the rest of the code does with EMFILE.
libzmq has no option that bounds how many connections a listener accepts, and it accepts on its own
I/O thread as fast as peers connect.

What holds instead, three layers:

1. ``raise_nofile_limit``: the soft RLIMIT_NOFILE goes to the hard limit at start (systemd's
   default hard limit is 524288; a soft 1024 is only a default).
2. ``connection_limit``: connections are capped at a third of what the table leaves after
   ``FD_RESERVE`` descriptors for the daemon's own files (arena, NVMe data and index with its WAL,
   eventfds of the copy engines, libzmq mailboxes, the metrics exporter); sessions are capped at
   the same number (a session's staging buffer may hold a descriptor), and the last third absorbs
   the connections libzmq accepts before the guard reacts.
3. ``ConnectionGuard``, a thread of its own (so a long request on the loop thread does not delay
   it), reads the socket monitor: EVENT_ACCEPTED carries the new connection's descriptor and
   EVENT_DISCONNECTED the closed one's. Connections past the cap are refused at once with
   ``shutdown(2)`` (not ``close``: libzmq owns the descriptor; it sees EOF, closes it itself and
   reports the disconnect), newest first, so established sessions keep being served. At the cap
   the ipc socket file is also renamed to a hidden name, so new ``connect(2)`` calls fail with
   ENOENT in the client (ZeroMQ retries them) instead of costing the daemon a descriptor; only
   connections already queued in the listen backlog (``ZMQ_BACKLOG``, 100) still arrive. The name
   comes back once connections fall below 90 % of the cap.

So the descriptors a burst can take are bounded by the cap, the backlog and what arrives while the
guard thread reacts (milliseconds), against a headroom of the cap again (the sessions' third is
only used by sessions, which are capped as well).

**Per user.** A connection's owner is the uid the kernel recorded for it (SO_PEERCRED of the
accepted descriptor; a tcp peer: its address). An owner past ``per_owner_limit`` connections has
its newest refused the same way, without hiding the socket, so one uid's idle connections cannot
fill the global cap (and hide the socket from everyone else); only several owners together can. A TCP endpoint cannot be
hidden, but libzmq's TCP listener survives EMFILE (it drops the connection).
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import socket as pysocket
import struct
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger(__name__)

FD_RESERVE = 256  # descriptors kept for the daemon's own files, never for connections
MONITOR_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
POLL_MS = 100  # how often the guard thread looks at its stop flag
_UCRED = struct.Struct("=iII")  # struct ucred: pid, uid, gid


def raise_nofile_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; return the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("RLIMIT_NOFILE: could not raise the soft limit %d to %d: %s", soft,
                        target, exc)
            return soft
        log.info("RLIMIT_NOFILE: soft limit raised from %d to the hard limit %d", soft, target)
        return target
    log.info("RLIMIT_NOFILE: soft limit %d, hard limit %d", soft, hard)
    return soft


def connection_limit(configured: int, nofile: int) -> int:
    """The connection cap in force: ``max_connections`` or what fits under ``nofile``."""
    room = max(0, nofile - FD_RESERVE) // 3
    limit = max(1, min(configured, room))
    if limit < configured:
        log.warning("max_connections lowered from %d to %d to fit under RLIMIT_NOFILE %d "
                    "(%d descriptors reserved; of the rest, a third for connections, a third for "
                    "sessions, a third as headroom)", configured, limit, nofile, FD_RESERVE)
    return limit


class ConnectionGuard:
    """Counts the ROUTER's connections from its monitor and refuses those past ``limit``, and
    those of one owner past ``per_owner_limit``.

    ``on_change(live, refused, refused_per_owner)`` is called (from the guard thread) after each
    batch of events; ``on_disconnect(monotonic_time)`` after a batch that held at least one
    disconnect, so the loop can probe its sessions.
    """

    def __init__(self, monitor: zmq.Socket, limit: int, ipc_path: Path | None,
                 on_change: Callable[[int, int, int], None],
                 on_disconnect: Callable[[float], None],
                 per_owner_limit: int | None = None) -> None:
        self.monitor = monitor
        self.limit = limit
        self.per_owner_limit = per_owner_limit or limit
        self.ipc_path = ipc_path
        self.on_change = on_change
        self.on_disconnect = on_disconnect
        self.live: dict[int, object] = {}  # descriptor -> owner, in accept order (dicts keep it)
        self.per_owner: Counter = Counter()  # owner -> live connections not being refused
        self.refusing: set[int] = set()  # shut down, waiting for libzmq's disconnect
        self.refused_total = 0
        self.refused_per_owner_total = 0
        self.hidden = False
        self._low = max(1, self.limit * 9 // 10)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtierd-connections",
                                        daemon=True)

    def stats(self) -> dict[str, int | bool]:
        """For STATS (read from the loop thread; plain ints and a bool)."""
        return {"open": len(self.live), "max": self.limit, "refused": self.refused_total,
                "max_per_uid": self.per_owner_limit,
                "refused_per_uid": self.refused_per_owner_total, "hidden": self.hidden}

    @staticmethod
    def hidden_path(path: Path) -> Path:
        return path.with_name(f".{path.name}.full")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and give the socket file its name back (the daemon removes it)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._show()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.monitor, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if poller.poll(POLL_MS):
                    self._drain()
            except zmq.ZMQError as exc:
                if exc.errno == zmq.ETERM:
                    return
                log.exception("connection guard: monitor read failed")
            except Exception:
                log.exception("connection guard failed; it keeps running")

    def _drain(self) -> None:
        disconnected = False
        per_owner = 0
        while True:
            try:
                event = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
            fd = event["value"]
            if event["event"] == zmq.EVENT_ACCEPTED:
                per_owner += self._accepted(fd)
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                owner = self.live.pop(fd, None)
                if fd in self.refusing:
                    self.refusing.discard(fd)
                elif owner is not None:
                    self._release(owner)
                disconnected = True
        refused = self._refuse_excess()
        self._gate()
        self.on_change(len(self.live), refused, per_owner)
        if disconnected:
            self.on_disconnect(time.monotonic())

    def _accepted(self, fd: int) -> int:
        """Record a new connection; refuse it (1) when its owner already has its share."""
        owner = owner_of(fd)
        self.live[fd] = owner
        if self.per_owner[owner] < self.per_owner_limit or self.per_owner_limit >= self.limit:
            self.per_owner[owner] += 1
            return 0
        _shutdown(fd)
        self.refusing.add(fd)
        self.refused_per_owner_total += 1
        if self.refused_per_owner_total in (1, 10, 100) or not self.refused_per_owner_total % 1000:
            log.warning("connection of %s refused: it has %d open, max_connections_per_uid is "
                        "%d (%d refused so far)", _describe(owner), self.per_owner[owner],
                        self.per_owner_limit, self.refused_per_owner_total)
        return 1

    def _release(self, owner: object) -> None:
        """One connection of ``owner`` no longer counts towards its share."""
        self.per_owner[owner] -= 1
        if self.per_owner[owner] <= 0:
            del self.per_owner[owner]

    def _refuse_excess(self) -> int:
        excess = len(self.live) - len(self.refusing) - self.limit
        if excess <= 0:
            return 0
        newest = [fd for fd in reversed(self.live) if fd not in self.refusing][:excess]
        for fd in newest:
            _shutdown(fd)
            self.refusing.add(fd)
            self._release(self.live[fd])
        self.refused_total += len(newest)
        log.warning("%d connection(s) refused: %d open, max_connections is %d (total refused %d)",
                    len(newest), len(self.live), self.limit, self.refused_total)
        return len(newest)

    def _gate(self) -> None:
        if len(self.live) >= self.limit:
            self._hide()
        elif len(self.live) < self._low:
            self._show()

    def _hide(self) -> None:
        if self.hidden or self.ipc_path is None:
            return
        try:
            os.rename(self.ipc_path, self.hidden_path(self.ipc_path))
        except OSError as exc:
            log.error("could not hide %s at max_connections: %s", self.ipc_path, exc)
            return
        self.hidden = True
        log.warning("max_connections (%d) reached: %s hidden until connections close",
                    self.limit, self.ipc_path)

    def _show(self) -> None:
        if not self.hidden or self.ipc_path is None:
            return
        try:
            os.rename(self.hidden_path(self.ipc_path), self.ipc_path)
        except OSError as exc:
            log.error("could not restore %s: %s", self.ipc_path, exc)
            return
        self.hidden = False
        log.info("%s accepts connections again (%d open)", self.ipc_path, len(self.live))


def owner_of(fd: int) -> object:
    """Whose connection ``fd`` is: ``("uid", N)`` from SO_PEERCRED on a Unix socket, ``("addr",
    IP)`` for a tcp peer, ``("unknown", None)`` when neither can be read (gone meanwhile)."""
    try:
        sock = pysocket.socket(fileno=fd)
    except OSError:
        return ("unknown", None)
    try:
        if sock.family == pysocket.AF_UNIX:
            raw = sock.getsockopt(pysocket.SOL_SOCKET, pysocket.SO_PEERCRED, _UCRED.size)
            return ("uid", _UCRED.unpack(raw)[1])
        return ("addr", sock.getpeername()[0])
    except OSError:
        return ("unknown", None)
    finally:
        sock.detach()  # the descriptor stays libzmq's


def _describe(owner: object) -> str:
    kind, value = owner  # type: ignore[misc]
    return f"uid {value}" if kind == "uid" else f"{value}" if kind == "addr" else "an unknown peer"


def _shutdown(fd: int) -> None:
    """shutdown(2) a connection libzmq owns: it reads EOF, closes the descriptor and reports it."""
    try:
        sock = pysocket.socket(fileno=fd)
    except OSError as exc:  # closed meanwhile (ENOTSOCK, EBADF): nothing left to refuse
        log.debug("connection %d already gone: %s", fd, exc)
        return
    try:
        sock.shutdown(pysocket.SHUT_RDWR)
    except OSError as exc:
        if exc.errno != errno.ENOTCONN:
            log.debug("shutdown of connection %d: %s", fd, exc)
    finally:
        sock.detach()  # the descriptor stays libzmq's
