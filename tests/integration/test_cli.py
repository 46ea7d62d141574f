"""The ``kvtierd`` command line, run as a subprocess (``python -m kvtierd``) against real
daemons."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.handshake import inline_staging
from helpers.raw import RawClient

from kvtierd.protocol import PROTOCOL_VERSION, Op

pytestmark = pytest.mark.timeout(60)

MiB = 1024**2


def kvtierd(*args: str, env: dict[str, str] | None = None, timeout: float = 30.0
            ) -> subprocess.CompletedProcess:
    """Run the CLI with no KVTIERD_* variables from the outer environment (unless given)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVTIERD_")}
    clean.update(env or {})
    return subprocess.run([sys.executable, "-m", "kvtierd", *args], capture_output=True,
                          text=True, timeout=timeout, env=clean)


def socket_path(address: str) -> Path:
    assert address.startswith("ipc://")
    return Path(address[len("ipc://"):])


def printed_sources(stdout: str) -> dict[str, tuple[str, str]]:
    """check-config's ``key = value  (source)`` lines as key -> (value, source)."""
    lines = stdout.strip().splitlines()
    assert lines[-1].startswith("config OK: "), stdout
    out = {}
    for line in lines[:-1]:
        key, _, rest = line.partition(" = ")
        value, _, source = rest.rpartition("  (")
        assert source.endswith(")"), line
        out[key.strip()] = (value.strip(), source[:-1])
    return out


def printed_config(stdout: str) -> dict[str, str]:
    return {key: value for key, (value, _) in printed_sources(stdout).items()}


def stats_json(address: str) -> dict:
    result = kvtierd("stats", "--socket", address, "--json", "--timeout", "10")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


# -- check-config ------------------------------------------------------------------------------
VALID_TOML = """\
socket = "ipc:///tmp/kvtierd-cli-test/kvtierd.sock"
cpu_bytes = "32MiB"
page_bytes = "64KiB"
max_batch = 100
metrics_addr = "off"
auth_token = "t0p-secret"
"""


@pytest.mark.parametrize("wrap", [False, True], ids=["top-level", "kvtierd-table"])
def test_check_config_prints_the_keys_and_exits_0(tmp_path, wrap):
    path = tmp_path / "kvtierd.toml"
    path.write_text(("[kvtierd]\n" if wrap else "") + VALID_TOML)
    result = kvtierd("check-config", str(path))
    assert result.returncode == 0, result.stderr
    keys = printed_config(result.stdout)
    assert keys["socket"] == "ipc:///tmp/kvtierd-cli-test/kvtierd.sock"
    assert keys["cpu_bytes"] == str(32 * MiB)
    assert keys["page_bytes"] == str(64 * 1024)
    assert keys["max_batch"] == "100"
    assert keys["metrics_addr"] == "off"
    assert keys["auth_token"] == "***"
    assert "t0p-secret" not in result.stdout + result.stderr
    # every key is printed, defaults included
    for key in ("max_header_bytes", "max_inline_bytes", "session_timeout_s", "eviction_policy"):
        assert key in keys
    assert result.stdout.strip().endswith(f"config OK: {path}")


INVALID = {
    # name: (TOML text, fragments of stderr)
    "page-bytes-not-4k": ("page_bytes = 1000\n", ["'page_bytes'", "1000", "4096"]),
    "cpu-bytes-not-a-size": ('cpu_bytes = "lots"\n', ["'cpu_bytes'", "'lots'"]),
    "unknown-key": ("bogus_key = 3\n", ["'bogus_key'", "3", "cpu_bytes"]),
    "zero-batch": ("max_batch = 0\n", ["'max_batch'", "0"]),
    "remote-socket": ('socket = "tcp://10.1.2.3:5555"\n', ["'socket'", "tcp://10.1.2.3:5555"]),
    "bad-watermarks": ("high_watermark = 0.5\nlow_watermark = 0.9\n", ["watermark", "0.9"]),
    "not-toml": ("cpu_bytes = = 3\n", ["'config'", "TOML"]),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_check_config_rejects_invalid_values_with_exit_2(tmp_path, case):
    text, fragments = INVALID[case]
    path = tmp_path / "bad.toml"
    path.write_text(text)
    result = kvtierd("check-config", str(path))
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "config OK" not in result.stdout
    for fragment in fragments:
        assert fragment in result.stderr, (fragment, result.stderr)
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_check_config_rejects_a_bad_flag_and_a_missing_file(tmp_path):
    path = tmp_path / "ok.toml"
    path.write_text(VALID_TOML)
    result = kvtierd("check-config", str(path), "--page-bytes", "1000")
    assert result.returncode == 2 and "'page_bytes'" in result.stderr and "1000" in result.stderr
    missing = tmp_path / "nope.toml"
    result = kvtierd("check-config", str(missing))
    assert result.returncode == 2 and str(missing) in result.stderr, result.stderr


def test_check_config_without_a_file_uses_environment_and_defaults():
    result = kvtierd("check-config", env={"KVTIERD_CPU_BYTES": "24MiB"})
    assert result.returncode == 0, result.stderr
    assert printed_config(result.stdout)["cpu_bytes"] == str(24 * MiB)
    assert printed_sources(result.stdout)["page_bytes"][1] == "default"
    assert "config OK: (no file: environment and defaults)" in result.stdout


def test_config_precedence_flag_over_env_over_file(tmp_path):
    path = tmp_path / "kvtierd.toml"
    path.write_text('cpu_bytes = "8MiB"\nmetrics_addr = "off"\n')
    assert printed_config(kvtierd("check-config", str(path)).stdout)["cpu_bytes"] == str(8 * MiB)
    env = {"KVTIERD_CPU_BYTES": "32MiB"}
    result = kvtierd("check-config", str(path), env=env)
    assert printed_config(result.stdout)["cpu_bytes"] == str(32 * MiB), result.stderr
    assert printed_sources(result.stdout)["cpu_bytes"][1] == "env"
    result = kvtierd("check-config", str(path), "--cpu-bytes", "16MiB", env=env)
    assert printed_config(result.stdout)["cpu_bytes"] == str(16 * MiB), result.stderr
    sources = printed_sources(result.stdout)
    assert sources["cpu_bytes"][1] == "flag" and sources["metrics_addr"] == ("off", "file")
    assert sources["page_bytes"][1] == "default"
    # a misspelt variable is not silently ignored: a warning naming it and the closest key
    result = kvtierd("check-config", str(path), env={"KVTIERD_CPU_BYTE": "32MiB"})
    assert result.returncode == 0, result.stderr
    assert "KVTIERD_CPU_BYTE " in result.stderr and "KVTIERD_CPU_BYTES?" in result.stderr
    assert printed_config(result.stdout)["cpu_bytes"] == str(8 * MiB)


# -- stats -------------------------------------------------------------------------------------
def _traffic(address: str) -> None:
    """One stored chunk; LOOKUP 1 hit + 1 miss; GET 1 hit + 3 misses."""
    raw = RawClient(address)
    try:
        reply, _ = raw.request(Op.HELLO, namespace="cli", rank=0, world_size=1, fingerprint="fp-a",
                               staging=inline_staging(address))
        assert reply["name"] == "OK", reply
        reply, _ = raw.request(Op.PUT, [b"x" * 1000], items=[[b"k", 0, 1000]])
        assert reply["results"] == [0], reply
        reply, _ = raw.request(Op.LOOKUP, keys=[b"k", b"missing"])
        assert reply["tiers"] == [1, 0], reply
        reply, _ = raw.request(Op.GET, items=[[b"k", 0, 1000], [b"m1", 0, 1], [b"m2", 0, 1],
                                              [b"m3", 0, 1]])
        assert reply["results"] == [0, 10, 10, 10], reply
    finally:
        raw.close()


def test_stats_prints_a_table_with_tiers_and_hit_rates(daemon):
    _traffic(daemon.address)
    result = kvtierd("stats", "--socket", daemon.address)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"socket  {daemon.address}" in out
    assert f"protocol {PROTOCOL_VERSION}" in out
    tables, planning = out.split("\ncapacity planning", 1)  # planning: test_ghost_metrics.py
    rows = {line.split()[0]: line.split() for line in tables.splitlines() if line.strip()}
    assert rows["tier"] == ["tier", "capacity", "used", "used%", "chunks", "pending",
                            "evictions"], out
    cpu = rows["cpu"]
    assert cpu[1:3] == ["64.0", "MiB"], out  # capacity
    assert cpu[3:5] == ["64.0", "KiB"], out  # used: one page
    assert cpu[-3:] == ["1", "0", "0"], out  # chunks, pending, evictions
    assert "hit rate" in out
    assert rows["lookup"] == ["lookup", "1", "1", "50.0%"], out
    assert rows["get"] == ["get", "1", "3", "25.0%"], out


def test_stats_json(daemon_factory):
    d = daemon_factory(cpu_bytes="16MiB")
    _traffic(d.address)
    stats = stats_json(d.address)
    assert stats["tiers"]["cpu"]["capacity_bytes"] == 16 * MiB
    assert stats["tiers"]["cpu"]["chunks"] == 1
    assert stats["daemon"]["socket"] == d.address
    assert stats["daemon"]["page_bytes"] == 64 * 1024
    assert stats["daemon"]["pid"] == d.proc.pid
    assert stats["counts"] == {"lookup_hits": 1, "lookup_misses": 1, "lookup_hits_cpu": 1,
                               "get_served": 1, "get_failed": 3}


def test_env_var_is_overridden_by_the_flag(daemon_factory):
    d = daemon_factory(cpu_bytes="16MiB", env={"KVTIERD_CPU_BYTES": "32MiB"})
    assert "--cpu-bytes" in d.flags and "16MiB" in d.flags
    assert stats_json(d.address)["tiers"]["cpu"]["capacity_bytes"] == 16 * MiB


# -- ping --------------------------------------------------------------------------------------
def test_ping_a_live_daemon(daemon):
    result = kvtierd("ping", "--socket", daemon.address)
    assert result.returncode == 0, result.stderr
    assert daemon.address in result.stdout and "alive" in result.stdout


@pytest.mark.parametrize("command", ["ping", "stats"])
def test_ping_and_stats_fail_at_once_without_a_socket_file(tmp_path, command):
    """No socket file: said at once ("no socket at"), not after the reply timeout."""
    address = f"ipc://{tmp_path / 'nobody-home.sock'}"
    result = kvtierd(command, "--socket", address, "--timeout", "20", timeout=15)
    assert result.returncode == 1, result.stderr
    assert f"no socket at {tmp_path / 'nobody-home.sock'}" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("command", ["ping", "stats"])
def test_ping_and_stats_give_up_after_the_timeout_when_nothing_answers(tmp_path, command):
    """A socket that accepts but never answers (a wedged daemon): the timeout message."""
    path = tmp_path / "mute.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(8)
    try:
        result = kvtierd(command, "--socket", f"ipc://{path}", "--timeout", "0.5", timeout=15)
    finally:
        listener.close()
    assert result.returncode == 1
    assert str(path) in result.stderr and "0.5 s" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


# -- serve -------------------------------------------------------------------------------------
def test_second_daemon_on_the_same_socket_is_refused(daemon):
    before = daemon.stats()
    arena = f"kvtierd-test-second-{secrets.token_hex(6)}"
    result = kvtierd("serve", "--socket", daemon.address, "--cpu-bytes", "1MiB", "--page-bytes",
                     "64KiB", "--metrics-addr", "off", "--arena-name", arena, timeout=30)
    try:
        assert result.returncode == 1, (result.stdout, result.stderr)
        assert "already serving" in result.stderr and str(socket_path(daemon.address)) in (
            result.stderr), result.stderr
        assert "Traceback" not in result.stderr
        assert not (Path("/dev/shm") / arena).exists(), "the refused daemon left its arena"
    finally:
        (Path("/dev/shm") / arena).unlink(missing_ok=True)
    # the first daemon keeps its socket and keeps serving
    assert daemon.alive()
    assert socket_path(daemon.address).exists()
    assert kvtierd("ping", "--socket", daemon.address).returncode == 0
    assert daemon.stats()["daemon"]["pid"] == before["daemon"]["pid"]
    _traffic(daemon.address)
    assert daemon.cpu()["chunks"] == 1


def test_serve_with_an_invalid_flag_exits_2_before_mapping_anything(tmp_path):
    arena = f"kvtierd-test-invalid-{secrets.token_hex(6)}"
    address = f"ipc://{tmp_path / 'kvtierd.sock'}"
    result = kvtierd("serve", "--socket", address, "--cpu-bytes", "1MiB", "--page-bytes", "1000",
                     "--metrics-addr", "off", "--arena-name", arena, timeout=30)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "'page_bytes'" in result.stderr and "1000" in result.stderr
    assert not (Path("/dev/shm") / arena).exists()
    assert not socket_path(address).exists()


def test_sigterm_exits_0_and_removes_the_socket(daemon):
    sock = socket_path(daemon.address)
    assert sock.exists()
    _traffic(daemon.address)
    daemon.stop_and_verify()  # CHECK, SIGTERM, exit 0, arena gone, no traceback in the log
    assert not daemon.alive()
    assert not sock.exists(), "socket file left behind"
    assert "kvtierd stopped" in daemon.log()


def test_sigint_exits_0_and_removes_the_socket(daemon):
    sock = socket_path(daemon.address)
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGINT)
    assert daemon.proc.wait(timeout=20) == 0, daemon.log()
    assert not sock.exists(), "socket file left behind"
    assert not (Path("/dev/shm") / daemon.arena_name).exists(), "arena left in /dev/shm"
    assert "Traceback" not in daemon.log()
