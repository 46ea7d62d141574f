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
import socket as pysocket
from pathlib import Path

import zmq

from kvtierd.config import Config
from kvtierd.paths import MAX_IPC_PATH_BYTES
from kvtierd.server.handshake import HandshakeServer
from kvtierd.tiers.arena import SHM_DIR, reclaim_stale_arenas
from kvtierd.tiers.capacity import check_arena_fits

log = logging.getLogger(__name__)


class StartupError(RuntimeError):
    """The daemon cannot start; ``key`` is the config key to look at."""

    def __init__(self, key: str, value: str, reason: str) -> None:
        super().__init__(f"cannot start: {key} = {value!r}: {reason}")
        self.key = key


class AlreadyServing(StartupError):
    pass


def bind_router(cfg: Config) -> tuple[zmq.Context, zmq.Socket, zmq.Socket]:
    """The ROUTER socket bound to ``cfg.socket`` and its disconnect monitor; on any error nothing
    stays open (so no context is left to hang in ``term()``) and StartupError names the key."""
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
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
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
        _prepare_socket_dir(path.parent, mode)
    except OSError as exc:
        raise StartupError(key, endpoint, f"cannot create the directory {path.parent}: "
                           f"{exc.strerror}") from None
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise StartupError(key, endpoint, f"the directory {path.parent} is not writable "
                           "by this user (or is read-only)")
    claim_ipc_path(path, key)


def _prepare_socket_dir(directory: Path, mode: int) -> None:
    """Create the socket directory (0700) and add the search bits ``mode`` needs (a socket's
    group/other read-write bits are useless without search on its directory); never removes
    bits from a directory that has them (e.g. /tmp or /run)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    wanted = (0o010 if mode & 0o060 else 0) | (0o001 if mode & 0o006 else 0)
    current = directory.stat().st_mode & 0o7777
    if current & wanted == wanted:
        return
    try:
        os.chmod(directory, current | wanted)
    except OSError as exc:
        log.warning("cannot add search bits %o to socket directory %s (%s): other users may not "
                    "reach the sockets", wanted, directory, exc.strerror)


def claim_ipc_path(path: Path, key: str = "socket") -> None:
    """Remove a stale socket file left by a dead daemon; refuse to steal a live one."""
    if not path.exists() and not path.is_symlink():
        return
    probe = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:
        path.unlink(missing_ok=True)
        return
    except OSError as exc:
        raise AlreadyServing(key, str(path),
                             f"the path exists and is not a usable socket: {exc}") from None
    finally:
        probe.close()
    raise AlreadyServing(key, str(path), f"another kvtierd is already serving at {path}")


def serve_metrics(metrics, addr: str) -> str:
    """Start the /metrics exporter; its URL ("" when off); StartupError naming metrics_addr."""
    try:
        bound = metrics.serve(addr)
    except OSError as exc:
        reason = "the port is in use" if exc.errno == errno.EADDRINUSE else exc.strerror or exc
        raise StartupError("metrics_addr", addr, f"cannot listen: {reason}") from None
    return f"http://{bound[0]}:{bound[1]}/metrics" if bound else ""


def prepare_arena_room(cfg: Config, shm_dir: Path = SHM_DIR) -> None:
    """Free what dead daemons left in /dev/shm, then check that our arena fits."""
    name = cfg.resolved_arena_name()
    reclaim_stale_arenas(shm_dir, keep=name)
    try:  # our own file (a dead daemon's, or a persistent one) is reused: its blocks count free
        reusable = os.stat(shm_dir / name, follow_symlinks=False).st_blocks * 512
    except OSError:
        reusable = 0
    check_arena_fits(cfg.cpu_bytes, shm_dir, reusable)
