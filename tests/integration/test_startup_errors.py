"""What can fail at start fails before the arena is mapped, exits non-zero and names the key:
a taken TCP port, a taken metrics port, an ipc path longer than sun_path, a /dev/shm too small.
Before, a bind error logged "kvtierd stopping" and hung in zmq's Context.term() forever."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SHM = Path("/dev/shm")
pytestmark = pytest.mark.timeout(120)


def serve(*flags: str, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess,
                                                                    str]:
    """``kvtierd serve`` that must exit by itself (the timeout catches a hang); returns the
    result and the arena name it was given, which must not exist afterwards."""
    arena = f"kvtierd-test-start-{secrets.token_hex(6)}"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVTIERD_")}
    result = subprocess.run(
        [sys.executable, "-m", "kvtierd", "serve", "--cpu-bytes", "16MiB", "--nvme-bytes", "0",
         "--arena-name", arena, *flags],
        capture_output=True, text=True, timeout=60, env={**clean, **(env or {})})
    return result, arena


def assert_refused(result: subprocess.CompletedProcess, arena: str, *fragments: str,
                   code: int = 1) -> None:
    """Exit ``code`` (1: a start-up error; 2: invalid config), the fragments in stderr."""
    assert result.returncode == code, (result.returncode, result.stderr)
    for fragment in fragments:
        assert fragment in result.stderr, (fragment, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    assert "mapped" not in result.stderr, "the arena was mapped before the failing check"
    assert not (SHM / arena).exists(), "a refused start left its arena"


@pytest.fixture
def taken_port():
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    yield listener.getsockname()[1]
    listener.close()


def test_taken_tcp_port_exits_naming_the_socket_key(taken_port):
    address = f"tcp://127.0.0.1:{taken_port}"
    result, arena = serve("--socket", address, "--metrics-addr", "off")
    assert_refused(result, arena, "socket", address, "in use")


def test_taken_metrics_port_exits_naming_metrics_addr(tmp_path, taken_port):
    sock = tmp_path / "kvtierd.sock"
    addr = f"127.0.0.1:{taken_port}"
    result, arena = serve("--socket", f"ipc://{sock}", "--metrics-addr", addr)
    assert_refused(result, arena, "metrics_addr", addr, "in use")
    assert not sock.exists(), "the refused daemon left its socket file"


def test_ipc_path_longer_than_sun_path_exits_naming_the_socket_key(tmp_path):
    long_dir = tmp_path / ("d" * 60) / ("e" * 60)
    address = f"ipc://{long_dir / 'kvtierd.sock'}"
    # its handshake socket (the same path + ".hs") is refused by the config check already...
    result, arena = serve("--socket", address, "--metrics-addr", "off")
    assert_refused(result, arena, "'socket'", "107", code=2)
    # ...and with a short handshake path, by the bind, before the arena
    result, arena = serve("--socket", address, "--metrics-addr", "off", "--handshake-socket",
                          str(tmp_path / "k.hs"))
    assert_refused(result, arena, "socket", address, "107")
    assert not (tmp_path / "k.hs").exists()


MOUNT_SMALL_SHM = "mount --make-rprivate / && mount -t tmpfs -o size=64m tmpfs /dev/shm && "


def _in_small_shm(command: str) -> subprocess.CompletedProcess:
    """Run ``command`` (sh) in a private mount namespace whose /dev/shm is a 64 MiB tmpfs, as
    Docker gives a container by default."""
    return subprocess.run(["unshare", "--mount", "sh", "-c", MOUNT_SMALL_SHM + command],
                          capture_output=True, text=True, timeout=60)


needs_mount_ns = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="needs root and util-linux unshare to mount a private /dev/shm (CI runs as root)")


@needs_mount_ns
def test_a_socket_directory_it_cannot_write_exits_naming_the_socket_key(tmp_path):
    """A read-only directory (root ignores mode bits, not a read-only mount)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    arena = f"kvtierd-test-start-{secrets.token_hex(6)}"
    argv = [sys.executable, "-m", "kvtierd", "serve", "--socket", f"ipc://{ro / 'k.sock'}",
            "--cpu-bytes", "16MiB", "--nvme-bytes", "0", "--metrics-addr", "off",
            "--arena-name", arena]
    result = subprocess.run(["unshare", "--mount", "sh", "-c",
                             f"mount --make-rprivate / && mount -t tmpfs -o ro tmpfs {ro} && "
                             "exec " + " ".join(argv)], capture_output=True, text=True,
                            timeout=60)
    assert_refused(result, arena, "socket", str(ro / "k.sock"), "not writable")


@needs_mount_ns
@pytest.mark.parametrize("extra", [[], ["--no-prefault", "--no-mlock"]], ids=["default", "lazy"])
def test_a_512mib_arena_on_a_64mib_dev_shm_is_refused_with_the_fix(tmp_path, extra):
    argv = [sys.executable, "-m", "kvtierd", "serve", "--socket", f"ipc://{tmp_path / 'k.sock'}",
            "--cpu-bytes", "512MiB", "--nvme-bytes", "0", "--metrics-addr", "off", *extra]
    result = _in_small_shm("exec " + " ".join(argv) + "; ")
    assert result.returncode == 1, (result.returncode, result.stderr)
    for fragment in ("cpu_bytes", "512.0 MiB", "/dev/shm", "64.0 MiB", "--shm-size",
                     "medium: Memory", "sizeLimit"):
        assert fragment in result.stderr, (fragment, result.stderr)
    assert "Traceback" not in result.stderr and "mapped" not in result.stderr, result.stderr
    assert not (tmp_path / "k.sock").exists()


@needs_mount_ns
def test_an_arena_larger_than_dev_shm_is_enospc_at_start_never_sigbus_later():
    """Past the start-up check (called directly here): the arena's blocks are allocated at
    start, so a tmpfs too small is a clear error then, not a SIGBUS on some later first touch."""
    code = ("from kvtierd.tiers.arena import Arena, ArenaError\n"
            "try:\n"
            "    Arena('kvtierd-test-enospc', 128 * 1024**2, prefault=False, lock=False)\n"
            "except ArenaError as exc:\n"
            "    print('REFUSED', exc)\n"
            "import os; print('LEFT', os.listdir('/dev/shm'))\n")
    result = _in_small_shm(f"{sys.executable} -c \"{code}\"")
    assert result.returncode == 0, result.stderr
    assert "REFUSED" in result.stdout and "No space left" in result.stdout, result.stdout
    assert "LEFT []" in result.stdout, result.stdout


def test_systemd_gets_the_reason_in_status(tmp_path, taken_port):
    name = f"kvtierd-test-notify-{secrets.token_hex(4)}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind("\0" + name)  # an abstract name, as systemd hands out ("@...")
    listener.settimeout(0)
    try:
        addr = f"127.0.0.1:{taken_port}"
        result, arena = serve("--socket", f"ipc://{tmp_path / 'k.sock'}", "--metrics-addr", addr,
                              env={"NOTIFY_SOCKET": "@" + name})
        assert_refused(result, arena, "metrics_addr")
        got = []
        while True:
            try:
                got.append(listener.recv(65536).decode())
            except BlockingIOError:
                break
    finally:
        listener.close()
    status = [line for msg in got for line in msg.splitlines() if line.startswith("STATUS=")]
    assert status and "metrics_addr" in status[-1] and addr in status[-1], got
    assert not any("READY=1" in msg for msg in got), got
