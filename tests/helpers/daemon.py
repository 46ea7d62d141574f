"""A real ``kvtierd serve`` subprocess for tests, with its invariants checked at the end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kvtierd.config import read_toml
from kvtierd.control import DaemonUnavailable, call
from kvtierd.protocol import Op


#: The extensions setup.py builds: every one optional, each with a Python form.
COMPILED_PARTS = ("kvtierd.copy._ranges", "kvtierd.tiers._columns", "kvtierd.server._items",
                  "kvtierd.eviction._stamps", "kvtierd._key_sample", "kvtierd._ghost")
#: A launcher for ``DaemonProcess`` running ``kvtierd serve`` as a build without a C compiler
#: would: each compiled part's import fails (a ``None`` in ``sys.modules`` makes it raise
#: ImportError), so the daemon runs the Python forms.
WITHOUT_COMPILED_PARTS = [sys.executable, "-c", (
    "import sys\n"
    f"sys.modules.update(dict.fromkeys({COMPILED_PARTS!r}))\n"
    "from kvtierd.cli import main\n"
    "raise SystemExit(main())"), "serve"]


class DaemonProcess:
    def __init__(self, workdir: Path, flags: list[str], cpu_bytes: str = "64MiB",
                 page_bytes: str = "64KiB", env: dict | None = None,
                 nvme_bytes: str = "64MiB", preexec_fn=None,
                 launcher: list[str] | None = None) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.address = f"ipc://{workdir / 'kvtierd.sock'}"
        self.arena_name = f"kvtierd-test-{os.getpid()}-{workdir.name}-{id(self):x}"
        self.log_path = workdir / "daemon.log"
        self.flags = ["--socket", self.address, "--cpu-bytes", cpu_bytes, "--page-bytes",
                      page_bytes, "--metrics-addr", "127.0.0.1:0", "--arena-name",
                      self.arena_name, "--nvme-dir", str(workdir / "nvme"), "--nvme-bytes",
                      nvme_bytes, *flags]
        self.env = {**os.environ, **(env or {})}
        self.token = admin_token(flags, self.env)  # what STATS/CHECK present
        self.proc: subprocess.Popen | None = None
        self.preexec_fn = preexec_fn  # e.g. a lower RLIMIT_NOFILE for the daemon only
        # What runs "serve FLAGS": kvtierd itself, or a script that wires a test tier into it.
        self.launcher = launcher or [sys.executable, "-m", "kvtierd", "serve"]

    def start(self, timeout_s: float = 30.0, wait: bool = True) -> None:
        """Start the daemon; with ``wait``, return once it answers a PING."""
        self.token = admin_token(self.flags, self.env)  # a restart may run with another env
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [*self.launcher, *self.flags],
            stdout=self._log, stderr=subprocess.STDOUT, env=self.env, preexec_fn=self.preexec_fn)
        if not wait:
            return
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvtierd exited with {self.proc.returncode}:\n{self.log()}")
            try:
                call(self.address, Op.PING, timeout_s=0.5)
                return
            except DaemonUnavailable:
                continue
        raise RuntimeError(f"kvtierd did not answer within {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stats(self) -> dict:
        return call(self.address, Op.STATS, token=self.token)["stats"]

    def cpu(self) -> dict:
        return self.stats()["tiers"]["cpu"]

    def check(self) -> dict:
        """Run the daemon's invariant checks; raises if one is violated."""
        return call(self.address, Op.CHECK, token=self.token)["checked"]

    def metrics_text(self) -> str:
        url = self.stats()["daemon"]["metrics"]
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.read().decode()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def persistent(self) -> bool:
        return "--cpu-persistent" in self.flags

    def shm_files(self) -> list[Path]:
        """The arena and (persistent arenas) its index files in /dev/shm."""
        return sorted(Path("/dev/shm").glob(f"{self.arena_name}*"))

    def kill9(self) -> None:
        """SIGKILL the daemon. Its arena stays in /dev/shm, as after a real crash: the next daemon
        to start reclaims it (or, persistent, re-attaches it); tests must not clean up for it."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        self._log.close()

    def restart(self) -> None:
        """Start a new daemon process with the same flags, socket, arena name and NVMe dir."""
        assert self.proc is None or self.proc.poll() is not None, "still running"
        self.start()

    def stop_and_verify(self) -> None:
        """SIGTERM; the daemon must still be alive, pass CHECK, exit 0 and remove its arena."""
        if self.proc is None or self.proc.poll() is not None:
            if self.proc is not None:  # never started: no log file open
                self._log.close()
            for path in self.shm_files():  # the test is over: no daemon will start on it again
                path.unlink(missing_ok=True)
            return
        try:
            self.check()
        finally:
            self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:  # never left behind, whatever the test says
                self.proc.kill()
                self.proc.wait()
                code = None
            self._log.close()
        assert code is not None, f"kvtierd did not stop within 20 s of SIGTERM:\n{self.log()}"
        assert code == 0, f"kvtierd exited with {code}:\n{self.log()}"
        if self.persistent:  # kept on purpose for the next start; the test is over
            for path in self.shm_files():
                path.unlink(missing_ok=True)
        assert not Path(f"/dev/shm/{self.arena_name}").exists(), "arena left in /dev/shm"
        assert "Traceback" not in self.log(), self.log()

    def remove_nvme_data(self) -> None:
        """The test is over (not just this process: a restart may follow a stop): free the
        preallocated NVMe file now (a run starts ~150 daemons, and
        pytest keeps the last runs' tmp dirs), keeping the log and index for a post-mortem."""
        (self.workdir / "nvme" / "chunks.data").unlink(missing_ok=True)


def admin_token(flags: list[str], env: dict) -> str:
    """The token the daemon's STATS/CHECK need, from its env or ``--config`` file (as the daemon
    reads them: env over file; admin_token over auth_token)."""
    values: dict = {}
    if "--config" in flags:
        values = read_toml(flags[flags.index("--config") + 1])
    for key in ("auth_token", "admin_token"):
        values[key] = env.get(f"KVTIERD_{key.upper()}", values.get(key, ""))
    return str(values["admin_token"] or values["auth_token"])
