"""sd_notify datagrams to a real unix datagram socket: path and abstract names, watchdog pacing."""

from __future__ import annotations

import os
import secrets
import socket

import pytest

from kvtierd.notify import Notifier


@pytest.fixture(params=["path", "abstract"])
def listener(request, tmp_path):
    """(NOTIFY_SOCKET value, bound datagram socket) as systemd would hand them over."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        address = str(tmp_path / "notify.sock")
        sock.bind(address)
    else:
        name = f"kvtierd-test-{os.getpid()}-{secrets.token_hex(4)}"
        sock.bind("\0" + name)
        address = "@" + name
    sock.settimeout(5)
    yield address, sock
    sock.close()


def received(sock: socket.socket) -> list[str]:
    return sock.recv(4096).decode().split("\n")


def test_status_ready_stopping_arrive_as_datagrams(listener):
    address, sock = listener
    notifier = Notifier.from_env({"NOTIFY_SOCKET": address})
    assert notifier.enabled
    assert notifier.status("mapping   the\narena")
    assert received(sock) == ["STATUS=mapping the arena"]
    assert notifier.ready("serving on ipc:///x")
    assert received(sock) == ["READY=1", "STATUS=serving on ipc:///x"]
    assert notifier.stopping()
    assert received(sock) == ["STOPPING=1", "STATUS=stopping"]
    notifier.close()


def test_watchdog_is_paced_at_half_its_interval(listener):
    address, sock = listener
    notifier = Notifier.from_env({"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "2000000",
                                  "WATCHDOG_PID": str(os.getpid())})
    assert notifier.watchdog_interval_s == 1.0
    sent = [notifier.watchdog(now) for now in (100.0, 100.5, 100.99, 101.0, 101.2, 102.0)]
    assert sent == [True, False, False, True, False, True]
    assert [received(sock) for _ in range(3)] == [["WATCHDOG=1"]] * 3
    notifier.close()


def test_watchdog_meant_for_another_pid_or_unset_sends_nothing(listener):
    address, sock = listener
    for env in ({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": str(os.getpid() + 1)}, {},
                {"WATCHDOG_USEC": "garbage"}):
        notifier = Notifier.from_env({"NOTIFY_SOCKET": address, **env})
        assert not notifier.watchdog(1.0) and not notifier.watchdog(1e9)
        notifier.close()
    sock.settimeout(0.05)
    with pytest.raises(TimeoutError):
        sock.recv(4096)


def test_without_notify_socket_everything_is_a_no_op():
    notifier = Notifier.from_env({})
    assert not notifier.enabled
    assert not notifier.ready("x") and not notifier.status("x") and not notifier.stopping()


def test_a_socket_that_is_gone_is_warned_about_once_and_never_raises(tmp_path, caplog):
    notifier = Notifier.from_env({"NOTIFY_SOCKET": str(tmp_path / "missing.sock")})
    assert not notifier.ready("x")
    assert not notifier.stopping()
    notifier.close()
    warnings = [r for r in caplog.records if "cannot notify systemd" in r.getMessage()]
    assert len(warnings) == 1
