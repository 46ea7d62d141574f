"""The daemon's socket files: their directory's mode, and claiming a path at start (a stale file
left by a dead daemon is removed; a live daemon's, also one hidden at max_connections, is never
stolen)."""

from __future__ import annotations

import logging
import os
import socket as pysocket
from pathlib import Path

from kvtierd.server.connections import ConnectionGuard

log = logging.getLogger(__name__)


class AlreadyServing(RuntimeError):
    pass


def prepare_socket_dir(directory: Path, mode: int) -> None:
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


def claim_ipc_path(path: Path) -> None:
    """Remove a stale socket file left by a dead daemon; refuse to steal a live one (also one
    whose socket is hidden at max_connections)."""
    _claim_socket_file(ConnectionGuard.hidden_path(path))
    _claim_socket_file(path)


def _claim_socket_file(path: Path) -> None:
    if not path.exists():
        return
    probe = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except ConnectionRefusedError:
        path.unlink(missing_ok=True)
        return
    except OSError as exc:
        raise AlreadyServing(f"{path} exists and is not a usable socket: {exc}") from None
    finally:
        probe.close()
    raise AlreadyServing(f"another kvtierd is already serving at {path}")
