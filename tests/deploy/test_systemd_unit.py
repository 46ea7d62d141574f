"""deploy/systemd/kvtierd.service: `systemd-analyze verify` and `security`, and the daemon's side
of Type=notify against a real NOTIFY_SOCKET (READY=1 once it serves, WATCHDOG=1, STOPPING=1)."""

from __future__ import annotations

import os
import secrets
import shlex
import signal
import socket
import sys
import time
from pathlib import Path

import pytest
from helpers.daemon import DaemonProcess
from helpers.workload import DEPLOY

from kvtierd.cli import build_parser
from kvtierd.config import load_config
from kvtierd.control import call
from kvtierd.protocol import Op

pytestmark = pytest.mark.timeout(120)

UNIT = DEPLOY / "systemd" / "kvtierd.service"


def service_section() -> dict[str, list[str]]:
    """[Service] as key -> every value (systemd allows repeated keys)."""
    values: dict[str, list[str]] = {}
    section = None
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and line and not line.startswith("#"):
            key, _, value = line.partition("=")
            values.setdefault(key, []).append(value)
    return values


def installable_unit(tmp_path: Path) -> Path:
    """The unit with ExecStart pointing at this venv's kvtierd (verify checks that it exists)."""
    exe = Path(sys.executable).parent / "kvtierd"
    assert exe.exists(), exe
    text = UNIT.read_text().replace("/usr/local/bin/kvtierd", str(exe))
    path = tmp_path / "kvtierd.service"
    path.write_text(text)
    return path


def test_systemd_analyze_verify_accepts_the_unit_without_a_warning(systemd_analyze, tmp_path):
    result = systemd_analyze.run("verify", str(installable_unit(tmp_path)))
    assert result.returncode == 0 and not result.stderr.strip() and not result.stdout.strip(), \
        result.stdout + result.stderr


def test_systemd_analyze_verify_would_catch_a_broken_unit(systemd_analyze, tmp_path):
    """The check above is only worth something if verify reports mistakes like ours would be."""
    path = installable_unit(tmp_path)
    path.write_text(path.read_text().replace("LimitMEMLOCK=infinity", "LimitMEMLOCK=lots")
                    .replace("UMask=", "Umask="))
    result = systemd_analyze.run("verify", str(path))
    assert "lots" in result.stderr and "Umask" in result.stderr, result.stderr


def test_hardening_exposure_is_low(systemd_analyze, tmp_path):
    # systemd's scale: 0 (locked down) .. 10 (exposed); "OK" is below 3.5 (--threshold is x10).
    result = systemd_analyze.run("security", "--offline=true", "--threshold=30", "--no-pager",
                                 str(installable_unit(tmp_path)))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr


def test_the_unit_keeps_what_shared_memory_cuda_and_notify_need():
    svc = service_section()
    one = {k: v[-1] for k, v in svc.items()}
    assert one["Type"] == "notify" and one["NotifyAccess"] == "main"
    assert one["LimitMEMLOCK"] == "infinity"
    assert one["WatchdogSec"] and one["Restart"] == "on-failure"
    # the socket lives in the RuntimeDirectory, reachable by the group only
    assert one["RuntimeDirectory"] == "kvtierd" and one["RuntimeDirectoryMode"] == "0750"
    assert one["UMask"] == "0007"
    # options that would break /dev/shm sharing, the arena's warm restart, or CUDA
    assert one["PrivateDevices"] == "no" and one["RemoveIPC"] == "no"
    assert one.get("MemoryDenyWriteExecute", "no") == "no"
    assert one.get("PrivateIPC", "no") == "no"
    assert "DevicePolicy" not in one and "DeviceAllow" not in one
    assert one["User"] != "root" and one["NoNewPrivileges"] == "yes"
    # persistent tiers default to $XDG_STATE_HOME/kvtierd = the StateDirectory
    assert "XDG_STATE_HOME=/var/lib" in svc["Environment"] and one["StateDirectory"] == "kvtierd"


def test_exec_start_is_a_valid_command_line_with_a_valid_config():
    argv = shlex.split(service_section()["ExecStart"][-1])
    assert argv[0] == "/usr/local/bin/kvtierd"
    args = build_parser().parse_args(argv[1:])
    assert args.command == "serve" and args.config == "/etc/kvtierd/kvtierd.toml"
    # the example config installed there is valid, and puts the socket in the RuntimeDirectory
    cfg = load_config(DEPLOY / "kvtierd.toml", env={})
    assert cfg.socket == "ipc:///run/kvtierd/kvtierd.sock"
    assert cfg.ipc_path.parent == Path("/run") / service_section()["RuntimeDirectory"][-1]


def test_the_unit_sets_no_config_key_that_would_shadow_its_config_file():
    """Regression: Environment=KVTIERD_SOCKET=... silently overrode the config file's socket."""
    svc = service_section()
    assigned = [item.partition("=")[0] for line in svc["Environment"] for item in shlex.split(line)]
    shadowing = [k for k in assigned if k.startswith("KVTIERD_") and k != "KVTIERD_CONFIG"]
    assert assigned and not shadowing, assigned
    assert "EnvironmentFile" not in svc and "PassEnvironment" not in svc
    flags = [a for a in shlex.split(svc["ExecStart"][-1]) if a.startswith("-")]
    assert flags == ["--config"], flags


# -- the daemon's side of Type=notify ------------------------------------------------------------
def recv_all(sock: socket.socket, until: str, timeout_s: float = 30.0) -> list[list[str]]:
    """Datagrams (each a list of KEY=VALUE lines) until one contains ``until``."""
    got: list[list[str]] = []
    deadline = time.monotonic() + timeout_s
    while not any(until in d for d in got):
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            got.append(sock.recv(4096).decode().split("\n"))
        except TimeoutError:
            raise AssertionError(f"no {until} within {timeout_s} s; got {got}") from None
    return got


def test_daemon_notifies_ready_watchdog_and_stopping_on_a_real_notify_socket(tmp_path):
    name = f"kvtierd-notify-{os.getpid()}-{secrets.token_hex(4)}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind("\0" + name)  # an abstract name, as systemd hands out ("@...")
    daemon = DaemonProcess(tmp_path / "d", [], env={
        "NOTIFY_SOCKET": "@" + name, "WATCHDOG_USEC": "300000"})
    try:
        daemon.start(wait=False)
        before_ready = recv_all(listener, "READY=1")
        # READY=1 means serving: the socket answers at once
        call(daemon.address, Op.PING, timeout_s=2)
        assert before_ready[0][0].startswith("STATUS=mapping the CPU tier"), before_ready
        ready, status = before_ready[-1]
        assert ready == "READY=1"
        # READY waits for the arena's CUDA pinning; here (no CUDA) it says why there is none.
        assert status.startswith(f"STATUS=serving on {daemon.address}; arena pinning "), status
        # before READY: progress lines, and watchdog pings if pinning takes a while
        assert all(d[0].startswith("STATUS=") or d == ["WATCHDOG=1"] for d in before_ready[:-1]), \
            before_ready
        # the loop pings the watchdog (every 0.15 s here: half of WATCHDOG_USEC)
        for _ in range(3):
            assert recv_all(listener, "WATCHDOG=1")[-1] == ["WATCHDOG=1"]
        daemon.check()
        daemon.proc.send_signal(signal.SIGTERM)
        after = recv_all(listener, "STOPPING=1")
        assert after[-1][0] == "STOPPING=1"
        assert daemon.proc.wait(timeout=20) == 0, daemon.log()
    finally:
        listener.close()
        daemon.stop_and_verify()


def test_without_notify_socket_the_daemon_serves_as_before(daemon):
    assert "cannot notify systemd" not in daemon.log()
    assert call(daemon.address, Op.PING, timeout_s=2)["status"] == 0
