"""kvtierd.paths: the one rule for the default socket, shared by daemon, CLI and clients."""

from __future__ import annotations

import socket

from kvtierd import paths


def test_a_user_session_uses_its_runtime_dir():
    env = {"XDG_RUNTIME_DIR": "/run/user/1000"}
    assert paths.default_socket(env, uid=1000) == "ipc:///run/user/1000/kvtierd/kvtierd.sock"
    assert paths.default_socket(env, uid=0) == "ipc:///run/user/1000/kvtierd/kvtierd.sock"


def test_root_without_a_session_uses_the_system_socket():
    assert paths.default_socket({}, uid=0) == "ipc:///run/kvtierd/kvtierd.sock"


def test_candidates_cover_the_session_the_system_and_the_tmp_fallback():
    env = {"XDG_RUNTIME_DIR": "/run/user/1000"}
    assert paths.socket_candidates(env, uid=1000) == [
        "ipc:///run/user/1000/kvtierd/kvtierd.sock",
        "ipc:///run/kvtierd/kvtierd.sock",
        "ipc:///tmp/kvtierd-1000/kvtierd.sock",
    ]
    assert paths.socket_candidates({}, uid=0) == [
        "ipc:///run/kvtierd/kvtierd.sock", "ipc:///tmp/kvtierd-0/kvtierd.sock"]


def test_client_socket_takes_the_first_candidate_with_a_live_socket_file(tmp_path):
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    (tmp_path / "kvtierd").mkdir()
    first = f"ipc://{tmp_path / 'kvtierd' / 'kvtierd.sock'}"
    assert paths.client_socket(env) == first  # its directory exists: the daemon will bind there
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "kvtierd" / "kvtierd.sock"))
    listener.listen(1)
    try:
        assert paths.client_socket(env) == first
        assert paths.unreachable_reason(first) is None
    finally:
        listener.close()
    # the file stays, nobody listens: a dead daemon's socket
    assert "nothing listens" in paths.unreachable_reason(first)


def test_unreachable_reasons(tmp_path):
    assert paths.unreachable_reason(f"ipc://{tmp_path / 'none.sock'}") == (
        f"no socket at {tmp_path / 'none.sock'}")
    (tmp_path / "file").write_text("x")
    assert "is not a socket" in paths.unreachable_reason(f"ipc://{tmp_path / 'file'}")
    assert paths.unreachable_reason("tcp://127.0.0.1:1") is None  # only a request can tell


def test_a_socket_hidden_at_the_connection_limit_is_not_reported_missing(tmp_path):
    from kvtierd.server.connections import ConnectionGuard

    path = tmp_path / "kvtierd.sock"
    assert paths.hidden_socket_path(path) == ConnectionGuard.hidden_path(path)  # one name
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(paths.hidden_socket_path(path)))
    listener.listen(1)
    try:
        assert paths.unreachable_reason(f"ipc://{path}") is None
    finally:
        listener.close()
