"""What can fail at start, done first and failing loudly: binds, then the arena's room.

Everything here runs before the arena is mapped, so that a taken port, an ipc path the kernel cannot
bind or a /dev/shm too small ends the start within a second with one message naming the config key,
its value and the cause, instead of after minutes of prefaulting (or never: a ZeroMQ context with
an open socket blocks ``term()`` forever).
"""

from __future__ import annotations

import errno
import logging
import os
from functools import partial
from pathlib import Path

import zmq

from kvtierd.config import Config
from kvtierd.events import EventsBindError, NoEvents, make_events
from kvtierd.paths import MAX_IPC_PATH_BYTES
from kvtierd.server.admission import token_matches
from kvtierd.server.handshake import HandshakeServer
from kvtierd.server.socket_files import AlreadyServing, claim_ipc_path, prepare_socket_dir
from kvtierd.tiers.arena import SHM_DIR, reclaim_stale_arenas
from kvtierd.tiers.capacity import check_arena_fits

log = logging.getLogger(__name__)


class StartupError(RuntimeError):
    """The daemon cannot start; ``key`` is the config key to look at."""

    def __init__(self, key: str, value: str, reason: str) -> None:
        super().__init__(f"cannot start: {key} = {value!r}: {reason}")
        self.key = key


def bind_router(cfg: Config, monitor_events: int) -> tuple[zmq.Context, zmq.Socket, zmq.Socket]:
    """The ROUTER socket bound to ``cfg.socket`` and its monitor (``monitor_events``); on any
    error nothing stays open (so no context is left to hang in ``term()``) and StartupError
    names the key."""
    path = cfg.ipc_path
    if path is not None:
        _prepare_ipc_path("socket", cfg.socket, path, cfg.socket_mode_bits)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_frame_bytes)
        sock.setsockopt(zmq.SNDHWM, 10000)
        sock.setsockopt(zmq.RCVHWM, 10000)
        monitor = sock.get_monitor_socket(monitor_events)
        sock.bind(cfg.socket)
        if path is not None:
            os.chmod(path, cfg.socket_mode_bits)
    except zmq.ZMQError as exc:
        ctx.destroy(linger=0)
        raise StartupError("socket", cfg.socket, f"bind failed: {exc.strerror or exc}") from None
    except BaseException:
        ctx.destroy(linger=0)
        raise
    return ctx, sock, monitor


def bind_events(cfg: Config) -> NoEvents:
    """The kv-events publisher (a no-op one without ``events_addr``), bound before the arena: a
    taken events port ends the start with the key, the value and the cause."""
    try:
        return make_events(cfg)
    except EventsBindError as exc:
        raise StartupError(exc.key, exc.value, exc.reason) from None


def bind_handshake(server: HandshakeServer, cfg: Config) -> None:
    """Bind the staging handshake socket beside the ZeroMQ one (StartupError naming the key)."""
    key = "handshake_socket" if cfg.handshake_socket else "socket"
    path = cfg.handshake_path
    _prepare_ipc_path(key, str(path), path, cfg.socket_mode_bits)
    try:
        server.bind()
    except OSError as exc:
        raise StartupError(key, str(path), f"cannot bind the handshake socket: "
                           f"{exc.strerror or exc}") from None


def _prepare_ipc_path(key: str, endpoint: str, path: Path, mode: int) -> None:
    if len(os.fsencode(path)) > MAX_IPC_PATH_BYTES:
        raise StartupError(key, endpoint, f"the path has {len(os.fsencode(path))} bytes; a "
                           f"unix socket path holds at most {MAX_IPC_PATH_BYTES}: choose a "
                           "shorter one")
    try:
        prepare_socket_dir(path.parent, mode)
    except OSError as exc:
        raise StartupError(key, endpoint, f"cannot create the directory {path.parent}: "
                           f"{exc.strerror}") from None
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise StartupError(key, endpoint, f"the directory {path.parent} is not writable "
                           "by this user (or is read-only)")
    try:
        claim_ipc_path(path)  # a dead daemon's file is removed, a live one's never stolen
    except AlreadyServing as exc:
        raise StartupError(key, endpoint, str(exc)) from None


def serve_metrics(metrics, cfg: Config) -> str:
    """Start the /metrics exporter; its URL ("" when off); StartupError naming metrics_addr.
    Per-tenant series go to scrapes bearing admin_token or auth_token (or to every scrape, with
    expose_tenant_stats)."""
    addr = cfg.metrics_addr
    try:
        bound = metrics.serve(addr, partial(_opens_tenant_stats, cfg), cfg.expose_tenant_stats)
    except OSError as exc:
        reason = "the port is in use" if exc.errno == errno.EADDRINUSE else exc.strerror or exc
        raise StartupError("metrics_addr", addr, f"cannot listen: {reason}") from None
    return f"http://{bound[0]}:{bound[1]}/metrics" if bound else ""


def _opens_tenant_stats(cfg: Config, token: str) -> bool:
    """A scrape's bearer token shows per-tenant series: ``admin_token`` or ``auth_token``."""
    return token_matches(token, cfg.admin_token) | token_matches(token, cfg.auth_token)


def prepare_arena_room(cfg: Config, shm_dir: Path = SHM_DIR) -> None:
    """Free what dead daemons left in /dev/shm, then check that our arena fits."""
    name = cfg.resolved_arena_name()
    reclaim_stale_arenas(shm_dir, keep=name)
    try:  # our own file (a dead daemon's, or a persistent one) is reused: its blocks count free
        reusable = os.stat(shm_dir / name, follow_symlinks=False).st_blocks * 512
    except OSError:
        reusable = 0
    check_arena_fits(cfg.cpu_bytes, shm_dir, reusable)
