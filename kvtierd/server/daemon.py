"""The daemon process: one ROUTER socket and one loop thread that owns all tier and session state.

The loop polls three things: the ROUTER socket (requests), the copy engine's eventfd (copies that
completed on copy threads) and the socket monitor (peer disconnects). Nothing else touches the tier,
so it needs no locks; bytes move on copy threads that only see addresses.

Peer death is detected twice: a session silent for ``session_timeout_s`` is closed, and after
ZeroMQ disconnect events the loop probes the sessions' routing ids with an ``id: 0`` notice under
ROUTER_MANDATORY (coalesced and rate-limited: ``probes``); a peer that is gone answers EHOSTUNREACH
at once and its session is closed. (libzmq's ROUTER_NOTIFY would say which peer left, but it is a
draft option that the released wheels do not build.) The socket monitor itself is read by the
connection guard's thread (``connections``), which also bounds the number of connections.
Requests, from the socket to their reply, are ``request_loop.RequestServing``'s.
"""

from __future__ import annotations

import errno
import logging
import math
import signal
import threading
import time
from typing import Any, Callable

import zmq

from kvtierd import __version__, cuda_health, event_snapshot, native
from kvtierd.config import Config
from kvtierd.config_tenants import per_uid_cap
from kvtierd.copy.engine import CopyEngine
from kvtierd.events import NO_EVENTS, ChainEventsAdapter, EventsCollector, NoEvents
from kvtierd.ghost import GhostCaches, GhostCollector
from kvtierd.metrics import DaemonMetrics
from kvtierd.notify import Notifier
from kvtierd.peer import read_user_namespace
from kvtierd.protocol import PROTOCOL_VERSION, Op, ProtocolError, Status, pack, reply
from kvtierd.server import heap_trim, tier_setup
from kvtierd.server.accounting import Accounting
from kvtierd.server.admission import Admission
from kvtierd.server.connections import (
    MONITOR_EVENTS, ConnectionGuard, connection_limit, raise_nofile_limit)
from kvtierd.server.data_ops import DataOps
from kvtierd.server.handlers import OpHandlers
from kvtierd.server.handshake import HandshakeServer
from kvtierd.server.chain import TierChain
from kvtierd.server.gc_tuning import rare_collections
from kvtierd.server.probes import ProbeSchedule
from kvtierd.server.request_loop import RequestServing
from kvtierd.server.sessions import SessionTable
from kvtierd.server.socket_files import AlreadyServing  # noqa: F401 (the CLI's import)
from kvtierd.server.startup import (  # noqa: F401 (StartupError: the CLI's import)
    StartupError,
    bind_events,
    bind_handshake,
    bind_router,
    prepare_arena_room,
    serve_metrics,
)
from kvtierd.tenants import TenantTable
from kvtierd.server.tickets import TicketBook
from kvtierd.staging import MemfdStaging, seal_protects
from kvtierd.tiers.arena import Arena
from kvtierd.tiers.cpu import CpuTier
from kvtierd.tiers.lower import LowerTier, PublishPolicy
from kvtierd.tiers.base import TierIndex
from kvtierd.tiers.nvme_lower import NvmeLowerTier
from kvtierd.tiers.pinning import ArenaPinner

log = logging.getLogger(__name__)

TICK_S = 0.1  # housekeeping period: session and lease expiry, watermarks
NOTICE = pack(reply(0, Status.OK, notice="probe"))
MAX_TICKETS = 256  # handshakes awaiting their HELLO (each may hold a client's mapping)


def poll_timeout_ms(deadline: float, now: float) -> int:
    """How long the loop may sleep in ``poll`` before ``deadline``: whole milliseconds, rounded
    up. pyzmq truncates a float timeout, so the last millisecond before each housekeeping tick
    spun through hundreds of zero-timeout polls (an idle daemon's loop used 0.8 % of a core
    instead of 0.2 %)."""
    return max(0, math.ceil((deadline - now) * 1000))


class Daemon(RequestServing):
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.notifier = Notifier.from_env()  # systemd Type=notify; a no-op without NOTIFY_SOCKET
        self.metrics = DaemonMetrics()
        self.metrics.info.labels(__version__, str(PROTOCOL_VERSION)).set(1)
        # Before anything opens files: every connection costs a descriptor (see connections).
        self.max_connections = connection_limit(cfg.max_connections, raise_nofile_limit())
        self.ctx: zmq.Context | None = None
        self.events: NoEvents = NO_EVENTS
        self.socket: zmq.Socket | None = None
        self.guard: ConnectionGuard | None = None
        self.tickets = TicketBook(cfg.ticket_timeout_s, MAX_TICKETS)
        self.userns = read_user_namespace()
        if not self.userns.maps_every_id:
            log.warning("kvtierd runs outside the initial user namespace: %s",
                        self.userns.describe())
        # The handshake maps clients' memfds only once serve() starts its thread (self.arena
        # exists by then); binding it now lets a bad path fail before the arena.
        self.handshake = HandshakeServer(
            cfg.handshake_path, cfg.socket_mode_bits, self.tickets, self._memfd_opener(),
            cfg.max_staging_bytes, self.metrics.handshakes, self.userns)
        try:
            # Binds first: a taken port or an unbindable path ends the start before the arena.
            self.ctx, self.socket, self.monitor = bind_router(cfg, MONITOR_EVENTS)
            bind_handshake(self.handshake, cfg)
            self.events = bind_events(cfg)  # kv-events hook: bound before the arena
            self.metrics_address = serve_metrics(self.metrics, cfg)
            prepare_arena_room(cfg)
            self.notifier.status(f"mapping the CPU tier ({cfg.cpu_bytes} bytes)")
            started = time.perf_counter()
            self.arena = Arena(
                cfg.resolved_arena_name(), cfg.cpu_bytes, prefault=cfg.prefault, lock=cfg.mlock,
                persistent=cfg.cpu_persistent,
            )
        except BaseException as exc:
            self._abandon_start(exc)
            raise
        log.info(
            "arena /dev/shm/%s: %d bytes mapped in %.2f s (prefault=%s, mlocked=%s)",
            self.arena.name, cfg.cpu_bytes, time.perf_counter() - started, cfg.prefault,
            self.arena.locked,
        )
        try:
            self._build(cfg)
        except BaseException as exc:
            self._abandon_start(exc)
            self.arena.close(unlink=not cfg.cpu_persistent)
            raise

    def _memfd_opener(self) -> Callable[[int, object], MemfdStaging]:
        """What maps a handshake's memfd: ``MemfdStaging``, or, on a kernel where the daemon's
        F_SEAL_FUTURE_WRITE does not stop a client from punching its pages out, a refusal (the
        daemon's copies would fault the client's memory in, charged to the daemon)."""
        problem = seal_protects()
        if problem is not None:
            log.error("memfd staging is refused on this kernel: %s; clients need CUDA IPC or "
                      "inline staging (Linux 5.1 or later keeps sealed staging whole)", problem)

            def refuse(fd: int, nbytes: object) -> MemfdStaging:
                raise ProtocolError(Status.BAD_HANDLE, f"memfd staging is refused by this daemon: "
                                    f"on its kernel {problem}; use inline or CUDA IPC staging")
            return refuse
        cfg = self.cfg
        return lambda fd, nbytes: MemfdStaging(fd, nbytes, cfg.max_staging_bytes,
                                               self.arena.inode)

    def _abandon_start(self, exc: BaseException) -> None:
        """A start that failed after binding: report it, then close what was bound."""
        self._start_failed(exc)
        self.handshake.close()
        self.events.close()
        self._close_sockets()
        self.metrics.close()

    def _start_failed(self, exc: BaseException) -> None:
        """systemd shows the reason in ``systemctl status`` (STATUS=), as the log does."""
        if isinstance(exc, Exception):
            self.notifier.status(f"failed to start: {exc}")

    def _build(self, cfg: Config) -> None:
        self.tenants = TenantTable(cfg)
        self.tier = CpuTier(
            self.arena, cfg.page_bytes, policy=cfg.eviction_policy,
            high_watermark=cfg.high_watermark, low_watermark=cfg.low_watermark,
            quota_pages=self._quota_pages,
        )
        tier_setup.attach_arena_index(cfg, self.tier, self.arena)
        self.engine = CopyEngine(cfg.copy_threads)
        self.io_engine = CopyEngine(cfg.io_threads, inline_bytes=-1)  # disk I/O never inline
        self.mover = TierChain(self.tier, self._lower_tiers(cfg), self.io_engine, self.metrics)
        self.metrics.add_tiers(self.mover.tier_stats)
        self.sessions = SessionTable(self.tier, cfg.session_timeout_s, cfg.lease_timeout_s,
                                     lower=self.mover.lower)
        accounting = Accounting(self.metrics)
        # a session's staging buffer may hold a descriptor: no more sessions than connections
        max_sessions = min(cfg.max_sessions, self.max_connections)
        if max_sessions < cfg.max_sessions:
            log.warning("max_sessions lowered from %d to %d (max_connections in force)",
                        cfg.max_sessions, max_sessions)
        self.admission = Admission(cfg, self.metrics, max_sessions)
        self.handlers = OpHandlers(cfg, self.mover, self.sessions, self.metrics, accounting,
                                   self.tickets, self.tenants)
        self.handlers.max_sessions_per_uid = per_uid_cap(cfg.max_sessions_per_uid, max_sessions)
        self.handlers.metrics_address = self.metrics_address
        self.handlers.handshake_stats = self.handshake.counts
        self.handlers.send = self._send  # LOOKUPs answered after a lower tier's existence check
        self.pinner = ArenaPinner(self.arena.address, self.arena.nbytes)  # started by serve()
        self._ready_sent = False
        self._pinned_reported = -1
        self.handlers.pinning = self.pinner.stats
        self.data = DataOps(cfg, self.mover, self.sessions, self.engine, self.metrics, accounting,
                            self._send, self.tenants)
        self.metrics.add_tenants(self.tenants, self.tier)
        # Capacity planning: what each tier's hit ratio would be if it were 2x/4x larger.
        tiers = [(name, stats["capacity_bytes"]) for name, stats in self.mover.tier_stats()]
        self.handlers.ghosts = self.data.ghosts = GhostCaches(tiers, cfg.page_bytes)
        self.metrics.registry.register(GhostCollector(self.handlers.ghosts))
        self.metrics.prime(name for name, _ in tiers)
        self._wire_events()
        self._dispatch: dict[Op, Callable[..., Any]] = {
            Op.PING: self.handlers.ping,
            Op.STATS: self.handlers.stats,
            Op.LOOKUP: self.handlers.lookup,
            Op.PUT: self.data.put,
            Op.GET: self.data.get,
            Op.DELETE: self.handlers.delete,
            Op.BYE: self.handlers.bye,
            Op.CHECK: self.handlers.check,
        }
        self._stop = threading.Event()
        self._clean_stop = False
        self.probes = ProbeSchedule()
        self.idle_trim = heap_trim.IdleTrim()

    def _wire_events(self) -> None:
        """kv-events hooks: PUT commits with their ``blocks`` (DataOps), every store and drop of
        every tier (the chain's ChainEvents), every removal from the arena (CpuTier.on_remove);
        all no-ops without events_addr."""
        self.data.events = self.events
        if self.events.enabled:  # unset, DELETE removes compact chunks without building entries
            self.mover.events = ChainEventsAdapter(self.events)
            self.tier.on_remove = lambda entry: self.events.removed(entry.ikey, "cpu")
        self.metrics.registry.register(EventsCollector(self.events))

    def _quota_pages(self, tenant: str) -> int:
        """A tenant's quota in whole pages (rounded down, never past max_bytes), at least one:
        0 would mean "no quota"."""
        quota = self.tenants.quota_bytes(tenant)
        return max(1, quota // self.cfg.page_bytes) if quota else 0

    def _lower_tiers(self, cfg: Config) -> list[tuple[LowerTier, PublishPolicy]]:
        return tier_setup.lower_tiers(cfg, self.arena)

    # -- lifecycle -------------------------------------------------------------------------------
    def request_stop(self, *_: Any) -> None:
        self._stop.set()

    def serve(self, on_ready: Callable[[], None] | None = None) -> None:
        try:
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, self.request_stop)
                signal.signal(signal.SIGINT, self.request_stop)
            heap_trim.trim()  # the index loads' temporaries: their pages go back (heap_trim: why)
            self._start_threads()
            recovered = event_snapshot.take_for(self.cfg, self.arena.name, self._tier_indexes())
            if self.events.enabled:
                self.events.start()
                self.events.cleared()  # what an earlier run announced is void
                for tier, ikey, info in recovered:  # ... but what it recovered is here
                    self.events.stored(ikey, tier, info)
                self.events.flush()  # queued before any request is answered, not after the first
            log.info("kvtierd %s ready on %s (protocol %d, cpu tier %d bytes, page %d bytes, "
                     "%s)", __version__, self.cfg.socket, PROTOCOL_VERSION, self.cfg.cpu_bytes,
                     self.cfg.page_bytes, native.summary())
            if self.cfg.cuda_pin_arena:
                self.pinner.start()  # cudaHostRegister in the background (no CUDA: "unavailable")
            self._announce_when_pinned()
            if on_ready is not None:
                on_ready()
            with rare_collections():  # kvtierd.server.gc_tuning: why
                self._loop()
            self._clean_stop = True  # asked to stop, not ended by an error: snapshots are safe
        finally:
            self._shutdown()
        lost = cuda_health.lost()
        if lost:
            raise cuda_health.CudaContextLost(
                "CUDA context lost on " + ", ".join(f"device {d} ({why})" for d, why in
                                                   sorted(lost.items()))
                + "; exiting for the supervisor to restart kvtierd with a fresh context")

    def _announce_when_pinned(self) -> None:
        """systemd READY=1 once the arena is pinned (or pinning is off/impossible): requests are
        served meanwhile, but a unit ordered after kvtierd should find full-speed DMA."""
        if self._ready_sent:
            return
        if self.pinner.state == "pinning":
            if self.pinner.pinned_bytes != self._pinned_reported:  # progress, not every tick
                self._pinned_reported = self.pinner.pinned_bytes
                self.notifier.status(f"pinning the arena for CUDA: {self.pinner.pinned_bytes} "
                                     f"of {self.arena.nbytes} bytes registered")
            return
        self._ready_sent = True
        detail = f"arena pinning {self.pinner.state}" + (
            f" ({self.pinner.reason})" if self.pinner.reason else "")
        self.notifier.ready(f"serving on {self.cfg.socket}; {detail}")

    def _start_threads(self) -> None:
        """The handshake and connection-guard threads, on sockets bound at start (the monitor
        queued whatever connected meanwhile)."""
        self.handshake.start()
        per_uid = per_uid_cap(self.cfg.max_connections_per_uid, self.max_connections)
        self.guard = ConnectionGuard(self.monitor, self.max_connections, self.cfg.ipc_path,
                                     self._connections_changed, self.probes.disconnected,
                                     per_uid)
        self.guard.start()
        self.handlers.connections = self.guard.stats

    def _connections_changed(self, live: int, refused: int, refused_per_uid: int) -> None:
        """Called from the guard's thread (prometheus-client's metrics are thread-safe)."""
        self.metrics.connections.set(live)
        if refused:
            self.metrics.refused.labels("connections").inc(refused)
        if refused_per_uid:
            self.metrics.refused.labels("connections_per_uid").inc(refused_per_uid)

    def _loop(self) -> None:
        assert self.socket is not None
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self.engine.wake_fd, zmq.POLLIN)
        io_engines = {engine.wake_fd: engine for engine in self.mover.engines}
        for fd in io_engines:
            poller.register(fd, zmq.POLLIN)
        next_tick = time.monotonic() + TICK_S
        while not self._stop.is_set():
            events = dict(poller.poll(poll_timeout_ms(next_tick, time.monotonic())))
            if self.engine.wake_fd in events:
                self._drain_completions()
            for fd, engine in io_engines.items():
                if fd in events:
                    self._drain_io(engine)
            if self.socket in events:
                self._drain_requests()
            self.mover.flush()  # writes and deletes queued by what was just handled
            self._compact()
            self.events.flush()  # kv-events hook: this iteration's events, one batch per topic
            if cuda_health.any_lost():  # a sticky CUDA error: stop serving, exit for a restart
                self._stop.set()
                break
            now = time.monotonic()
            if now >= next_tick:
                next_tick = now + TICK_S
                self._housekeeping(now)

    def _compact(self) -> None:
        """Fold the chunks that went idle during this iteration back into the compact indexes:
        between iterations nobody holds an entry it has not referenced or pinned."""
        self.tier.compact()
        for tier in self.mover.lower:
            if isinstance(tier, TierIndex):  # a tier with a compact index (NVMe)
                tier.compact()

    def _drain_completions(self) -> None:
        for context, result, error in self.engine.completions():
            try:
                self.data.on_copy_done(context, result, error)
            except Exception:
                log.exception("completing a copy failed")

    def _drain_io(self, engine: CopyEngine) -> None:
        for job, result, error in engine.completions():
            try:
                self.mover.on_io_done(job, result, error)
            except Exception:
                log.exception("completing a lower-tier job failed")

    def _probe_sessions(self, since: float) -> None:
        """Probe the sessions not heard from since the latest disconnect (``probes``)."""
        assert self.socket is not None
        for session in list(self.sessions.by_identity.values()):
            if session.last_seen > since:
                continue  # it spoke after the disconnect: still there
            try:
                self.socket.send_multipart([session.identity, NOTICE], zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                if exc.errno == errno.EHOSTUNREACH:
                    self._close_session(session, "disconnected")
                # EAGAIN: its queue is full of replies it has not read; it is there

    def _housekeeping(self, now: float) -> None:
        self.notifier.watchdog(now)
        self.mover.probe()  # a tripped lower tier's probe, due even when no request comes
        self._announce_when_pinned()
        since = self.probes.due(now)
        if since is not None:
            self._probe_sessions(since)
        for session in self.sessions.expire(now):
            self.metrics.sessions_closed.labels("timeout").inc()
        self.metrics.sessions.set(len(self.sessions))
        self.tickets.expire(now)
        self.tier.enforce_watermarks()
        self.idle_trim.tick(now)  # the heap's free pages back after a busy spell (heap_trim)
        if self.data.waiting:
            self.data.retry_parked()
        self.mover.flush()  # after the retry: the promotions it queued start now, not next tick

    def _close_session(self, session: Any, reason: str) -> None:
        self.sessions.close(session, reason)
        self.metrics.sessions_closed.labels(reason).inc()
        self.metrics.sessions.set(len(self.sessions))

    def _shutdown(self) -> None:
        self.notifier.stopping()
        log.info("kvtierd stopping")
        deadline = time.monotonic() + 30.0
        self.mover.flush()
        while ((self.engine.in_flight or any(e.in_flight for e in self.mover.engines))
               and time.monotonic() < deadline):
            time.sleep(0.01)
            self._drain_completions()
            for engine in self.mover.engines:
                self._drain_io(engine)
            self.mover.flush()
        self.handshake.close()
        self.tickets.close_all()
        self.sessions.close_all("daemon stopping")
        self.engine.close()
        self.io_engine.close()
        snapshot = self._clean_stop and self.cfg.index_snapshot
        self.mover.close(snapshot=snapshot)
        events_path = event_snapshot.path_for(self.cfg, self.arena.name)
        if self.events.enabled and events_path is not None:
            event_snapshot.save(events_path, self.events.announcements())
        self.events.cleared()  # kv-events hook: what it announced goes with it (or is unknown)
        self.events.close()
        self._close_sockets()
        self.metrics.close()
        if self.tier.db is not None:
            if snapshot:
                self.tier.save_snapshot()
            self.tier.db.close()
        self.pinner.close()  # unregistered before the arena is unmapped
        self.arena.close(unlink=not self.cfg.cpu_persistent)
        log.info("kvtierd stopped")

    def _tier_indexes(self) -> dict[str, Any]:
        """The compact index of each tier that indexes its chunks here (the remote does not)."""
        indexes: dict[str, Any] = {"cpu": self.tier.index}
        indexes.update((t.name, t.index) for t in self.mover.lower if isinstance(t, NvmeLowerTier))
        return indexes

    def _close_sockets(self) -> None:
        """Close every socket before the context ends: ``term()`` with one left open blocks
        forever."""
        if self.guard is not None:
            self.guard.stop()  # the socket file gets its name back before it is removed
            self.guard = None
        if self.socket is not None:
            self.socket.disable_monitor()
            self.monitor.close(linger=0)
            self.socket.close(linger=0)
            self.socket = None
            if self.cfg.ipc_path is not None:
                self.cfg.ipc_path.unlink(missing_ok=True)
        if self.ctx is not None:
            self.ctx.destroy(linger=0)
            self.ctx = None
