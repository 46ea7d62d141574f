"""Where the daemon's socket is by default: one answer for the daemon, the CLI and every client.

A daemon and its clients that disagree about the default socket never meet (the CLI would ask a
socket nobody listens on), so this module is the only place that decides it. The client library
imports it (beside ``kvtierd.protocol``); it needs nothing but the standard library.

Rules, in order, for the socket a ``kvtierd serve`` with no ``socket`` setting binds:

1. ``$XDG_RUNTIME_DIR/kvtierd/kvtierd.sock`` when ``XDG_RUNTIME_DIR`` is set (a user's session);
2. ``/run/kvtierd/kvtierd.sock`` for root, or when ``/run/kvtierd`` exists and is writable by the
   daemon's user (the systemd unit's ``RuntimeDirectory``, the image's volume);
3. ``/tmp/kvtierd-<uid>/kvtierd.sock`` otherwise.

A client (the CLI's ``ping``/``stats``, ``KVTierClient``, the vLLM spec) without an address tries
these candidates plus the system socket and takes the first socket file that exists.
"""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path
from typing import Mapping

SYSTEM_RUNTIME_DIR = Path("/run/kvtierd")
SOCKET_NAME = "kvtierd.sock"
# sun_path holds 108 bytes on Linux, including the terminating NUL.
MAX_IPC_PATH_BYTES = 107


def _env(env: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if env is None else env


def default_runtime_dir(env: Mapping[str, str] | None = None, uid: int | None = None) -> Path:
    """The directory a daemon started in this environment puts its socket in (rules above)."""
    env = _env(env)
    uid = os.getuid() if uid is None else uid
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "kvtierd"
    if uid == 0 or (SYSTEM_RUNTIME_DIR.is_dir() and os.access(SYSTEM_RUNTIME_DIR, os.W_OK)):
        return SYSTEM_RUNTIME_DIR
    return Path(f"/tmp/kvtierd-{uid}")


def default_socket(env: Mapping[str, str] | None = None, uid: int | None = None) -> str:
    """The endpoint a daemon binds when no ``socket`` is configured."""
    return f"ipc://{default_runtime_dir(env, uid) / SOCKET_NAME}"


def socket_candidates(env: Mapping[str, str] | None = None, uid: int | None = None) -> list[str]:
    """Endpoints a client without an address tries, in order (no duplicates)."""
    env = _env(env)
    uid = os.getuid() if uid is None else uid
    dirs = [default_runtime_dir(env, uid), SYSTEM_RUNTIME_DIR]
    if env.get("XDG_RUNTIME_DIR"):
        dirs.append(Path(env["XDG_RUNTIME_DIR"]) / "kvtierd")
    dirs.append(Path(f"/tmp/kvtierd-{uid}"))
    out: list[str] = []
    for directory in dirs:
        endpoint = f"ipc://{directory / SOCKET_NAME}"
        if endpoint not in out:
            out.append(endpoint)
    return out


def ipc_path(endpoint: str) -> Path | None:
    """The file of an ``ipc://`` endpoint; None for any other transport."""
    return Path(endpoint[len("ipc://"):]) if endpoint.startswith("ipc://") else None


def hidden_socket_path(path: Path) -> Path:
    """Where a daemon at its connection limit parks its socket file (kvtierd.server.connections:
    new connects fail with ENOENT and ZeroMQ retries them until the name comes back)."""
    return path.with_name(f".{path.name}.full")


def is_socket_file(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(path.stat().st_mode)
    except OSError:
        return False


def client_socket(env: Mapping[str, str] | None = None, uid: int | None = None) -> str:
    """The endpoint a client without an address uses: the first candidate whose socket file
    exists; if none does yet (the daemon starts later), the first whose directory exists, else the
    first candidate."""
    candidates = socket_candidates(env, uid)
    for endpoint in candidates:
        if is_socket_file(ipc_path(endpoint)):  # type: ignore[arg-type]
            return endpoint
    for endpoint in candidates:
        if ipc_path(endpoint).parent.is_dir():  # type: ignore[union-attr]
            return endpoint
    return candidates[0]


def unreachable_reason(endpoint: str) -> str | None:
    """Why an ``ipc://`` endpoint certainly has no daemon (no socket file; a socket file nobody
    listens on), found at once instead of after a reply timeout; None if it may have one (and
    always for tcp://, which only a request can tell)."""
    path = ipc_path(endpoint)
    if path is None:
        return None
    if not path.exists():
        if is_socket_file(hidden_socket_path(path)):
            return None  # a daemon at its connection limit: ZeroMQ retries until it has room
        return f"no socket at {path}"
    if not is_socket_file(path):
        return f"{path} is not a socket"
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:
        return f"nothing listens on {path} (a daemon that died left it)"
    except PermissionError as exc:
        return f"cannot connect to {path}: {exc.strerror}"
    except OSError:
        return None  # e.g. a full backlog: let the request itself find out
    finally:
        probe.close()
    return None
