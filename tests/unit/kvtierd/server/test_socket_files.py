"""Claiming the ipc path at start: a stale file goes, a live daemon's is never stolen, also while
its socket is hidden at max_connections (renamed by the connection guard)."""

from __future__ import annotations

import socket

import pytest

from kvtierd.server.connections import ConnectionGuard
from kvtierd.server.socket_files import AlreadyServing, claim_ipc_path


def _listen(path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.listen(1)
    return sock


def test_a_live_daemon_with_its_socket_hidden_is_not_stolen(tmp_path):
    path = tmp_path / "kvtierd.sock"
    live = _listen(ConnectionGuard.hidden_path(path))
    try:
        with pytest.raises(AlreadyServing, match="already serving"):
            claim_ipc_path(path)
    finally:
        live.close()


def test_stale_files_under_both_names_are_removed(tmp_path):
    path = tmp_path / "kvtierd.sock"
    for name in (path, ConnectionGuard.hidden_path(path)):
        _listen(name).close()  # the file stays, nobody listens: a dead daemon's
    claim_ipc_path(path)
    assert not path.exists() and not ConnectionGuard.hidden_path(path).exists()
