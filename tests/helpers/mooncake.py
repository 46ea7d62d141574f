"""A real Mooncake Store for tests and benchmarks, inside a private network namespace.

``mooncake_master`` and its HTTP metadata server bind all interfaces (the metadata server ignores
its host flag), so they run in a namespace of their own (``unshare -n``) that has only loopback:
nothing listens on the machine's interfaces, and two runs at once never collide on ports (each
namespace has its own, so the fixed default ports are used). Whatever talks to the master must be
in the same namespace:

* a child process: ``preexec_fn=ns.preexec`` (``DaemonProcess(..., preexec_fn=ns.preexec)``) or
  ``ns.prefix() + argv`` (nsenter);
* this process: ``with ns.entered(): ...`` moves the *calling thread* in for the block (``setns``);
  sockets made inside stay in the namespace after it, and threads started inside (Mooncake's own)
  inherit it. Used for a Mooncake client in-process and to scrape a namespaced daemon's /metrics.

The namespace lives as long as its holder process (``cat`` reading a pipe from us): if the test
process dies, the pipe closes and the holder exits; processes still inside are killed by
``MooncakeMaster.stop`` / the fixtures.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import shutil
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
MASTER_PORT = 50051
METADATA_PORT = 8080
METRICS_PORT = 9003
_libc = ctypes.CDLL(None, use_errno=True)


def bin_dir() -> Path:
    return Path(sys.executable).parent


def unavailable_reason() -> str | None:
    """Why a real Mooncake Store cannot run here (None: it can)."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        return (f"Mooncake's Python client is not installed ({exc}): pip install -e '.[remote]' "
                "and apt-get install libibverbs1 librdmacm1 (.ci/run does both)")
    if not (bin_dir() / "mooncake_master").exists():
        return f"mooncake_master is not in {bin_dir()} (the remote extra installs it)"
    for tool in ("unshare", "nsenter", "ip"):
        if shutil.which(tool) is None:
            return f"{tool} (util-linux / iproute2) is needed for a private network namespace"
    if os.geteuid() != 0:
        return "a private network namespace (unshare -n) needs root, as CI runs"
    return None


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns(CLONE_NEWNET): {os.strerror(err)}")


class NetNs:
    """A private network namespace with loopback up; see the module docstring."""

    def __init__(self) -> None:
        self.holder = subprocess.Popen(
            ["unshare", "-n", "sh", "-c", "ip link set lo up && echo up && exec cat"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        line = self.holder.stdout.readline()
        if line.strip() != b"up":
            self.holder.kill()
            raise RuntimeError(f"unshare -n failed (exit {self.holder.wait()})")
        self.path = f"/proc/{self.holder.pid}/ns/net"
        self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)

    def prefix(self) -> list[str]:
        return ["nsenter", f"--net={self.path}"]

    def preexec(self) -> None:
        """For ``subprocess.Popen(preexec_fn=...)``: the child runs inside the namespace."""
        _setns(self._fd)

    @contextmanager
    def entered(self) -> Iterator[None]:
        home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:
            _setns(self._fd)
            try:
                yield
            finally:
                _setns(home)
        finally:
            os.close(home)

    def close(self) -> None:
        os.close(self._fd)
        if self.holder.poll() is None:
            self.holder.stdin.close()
            try:
                self.holder.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.holder.kill()
                self.holder.wait()
        self.holder.stdout.close()


class MooncakeMaster:
    """``mooncake_master`` with its embedded HTTP metadata server, in ``ns``."""

    def __init__(self, ns: NetNs, workdir: Path) -> None:
        self.ns = ns
        self.workdir = workdir
        self.log_path = workdir / "mooncake_master.log"
        self.proc: subprocess.Popen | None = None
        self.master_addr = f"127.0.0.1:{MASTER_PORT}"
        self.metadata_url = f"http://127.0.0.1:{METADATA_PORT}/metadata"

    def start(self, timeout_s: float = 30.0) -> None:
        argv = [str(bin_dir() / "mooncake_master"), "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={METADATA_PORT}", "--rpc_address=127.0.0.1",
                f"--rpc_port={MASTER_PORT}", "--metrics_host=127.0.0.1",
                f"--metrics_port={METRICS_PORT}",
                # A client that stops heartbeating is forgotten within seconds (a killed node).
                "--client_ttl=5"]
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=self._preexec)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}:\n"
                                   f"{self.log()[-4000:]}")
            if self._listening(MASTER_PORT) and self._listening(METADATA_PORT):
                return
            time.sleep(0.05)
        raise RuntimeError(f"mooncake_master not listening within {timeout_s} s")

    def _preexec(self) -> None:
        self.ns.preexec()
        # dies with the test process (else a killed run leaves it in an orphaned namespace)
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)

    def _listening(self, port: int) -> bool:
        with self.ns.entered():
            with socket.socket() as sock:
                return sock.connect_ex(("127.0.0.1", port)) == 0

    def kill(self) -> None:
        """SIGKILL (a crashed master: its metadata is lost, the clients' segments stay)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def remote_toml(self, **overrides: object) -> str:
        """A ``[remote]`` table for a daemon in the namespace (small segments for tests)."""
        values: dict[str, object] = {
            "master_addr": self.master_addr, "metadata_url": self.metadata_url,
            "local_hostname": "127.0.0.1", "global_segment_bytes": "64MiB",
            "local_buffer_bytes": "16MiB", "retry_s": 1.0, "connect_timeout_s": 2.0,
        }
        values.update(overrides)
        lines = ["[remote]"]
        for key, value in values.items():
            lines.append(f"{key} = {_toml(value)}")
        return "\n".join(lines) + "\n"


class SegmentServer:
    """Mooncake's standalone store process (``mooncake_client``) lending ``segment_bytes`` to the
    pool, so that benchmark clients (segment 0) move bytes to another process over TCP, as to
    another node."""

    def __init__(self, master: MooncakeMaster, segment_bytes: int) -> None:
        self.master = master
        self.log_path = master.workdir / "mooncake_client.log"
        segment_bytes = max(segment_bytes, 64 * 1024**2)  # Mooncake needs >= 16 MiB
        argv = [str(bin_dir() / "mooncake_client"), "--host=127.0.0.1",
                f"--global_segment_size={segment_bytes}", "--protocol=tcp",
                f"--master_server_address={master.master_addr}",
                f"--metadata_server={master.metadata_url}", "--port=50052", "--threads=2"]
        log = open(self.log_path, "ab")
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     preexec_fn=master._preexec)
        log.close()

    def wait_mounted(self, timeout_s: float = 30.0) -> None:
        """Until the master lends its segment (a put through a client without one succeeds)."""
        client = raw_client(self.master, segment_bytes=0)
        deadline = time.monotonic() + timeout_s
        try:
            with self.master.ns.entered():
                while time.monotonic() < deadline:
                    if self.proc.poll() is not None:
                        raise RuntimeError(f"mooncake_client exited with {self.proc.returncode}")
                    if client.put("kvtierd-probe", b"probe-bytes") == 0:
                        client.remove("kvtierd-probe", True)
                        return
                    time.sleep(0.2)
        finally:
            with self.master.ns.entered():
                client.close()
        raise RuntimeError(f"mooncake_client's segment not mounted within {timeout_s} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def raw_client(master: MooncakeMaster, segment_bytes: int = 16 * 1024**2):
    """Mooncake's own Python client in this process (in the master's namespace), as another
    program sharing the store would use it; ``close()`` it inside ``master.ns.entered()``."""
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    with master.ns.entered():
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
        rc = store.setup("127.0.0.1", master.metadata_url, segment_bytes, 16 * 1024**2, "tcp",
                         "", master.master_addr)
    if rc != 0:
        raise RuntimeError(f"Mooncake client setup failed with {rc}:\n{master.log()[-2000:]}")
    return store


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


@contextmanager
def mooncake_cluster(workdir: Path) -> Iterator[MooncakeMaster]:
    """A namespace with a running master; everything is stopped and removed on exit. For a
    process that has no Mooncake client of its own (a benchmark's parent, a subprocess)."""
    ns = NetNs()
    master = MooncakeMaster(ns, workdir)
    try:
        master.start()
        yield master
    finally:
        master.stop()
        ns.close()


_SHARED: MooncakeMaster | None = None


def shared_master(workdir: Path) -> MooncakeMaster:
    """The one master of this process, (re)started if needed, stopped at exit.

    One per process because Mooncake's client keeps process-wide RPC threads: the first client
    pins them to the namespace it was made in, so every later in-process client must use that
    namespace too (a second namespace's master is unreachable from them). Tests keep apart by
    ``cluster_id`` and tenants, as real clusters sharing one store do."""
    global _SHARED
    if _SHARED is None:
        _SHARED = MooncakeMaster(NetNs(), workdir)
        atexit.register(_stop_shared)
    if _SHARED.proc is None or _SHARED.proc.poll() is not None:
        _SHARED.start()
    return _SHARED


def _stop_shared() -> None:
    if _SHARED is not None:
        _SHARED.stop()
        _SHARED.ns.close()
