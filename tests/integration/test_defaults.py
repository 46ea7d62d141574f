"""Defaults that agree: ``kvtierd ping`` with no flags finds ``kvtierd serve`` with no flags, the
client and the vLLM spec resolve the same socket, a missing daemon is said at once; Kubernetes
service-link variables never stop the daemon or its health checks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.wait import wait_for

from kvtierd import paths
from kvtierd.control import DaemonUnavailable, call
from kvtierd.protocol import Op

pytestmark = pytest.mark.timeout(120)

SERVICE_LINKS = {  # what Kubernetes injects for a Service named "kvtierd" exposing 9464
    "KVTIERD_SERVICE_HOST": "10.96.0.17",
    "KVTIERD_SERVICE_PORT": "9464",
    "KVTIERD_SERVICE_PORT_METRICS": "9464",
    "KVTIERD_PORT": "tcp://10.96.0.17:9464",
    "KVTIERD_PORT_9464_TCP": "tcp://10.96.0.17:9464",
    "KVTIERD_PORT_9464_TCP_PROTO": "tcp",
    "KVTIERD_PORT_9464_TCP_PORT": "9464",
    "KVTIERD_PORT_9464_TCP_ADDR": "10.96.0.17",
}


def private_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """No KVTIERD_* from outside, a private runtime dir and home: never the real /run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVTIERD_", "XDG_"))}
    env.update(XDG_RUNTIME_DIR=str(tmp_path / "run"), HOME=str(tmp_path / "home"))
    (tmp_path / "run").mkdir(mode=0o700, exist_ok=True)
    env.update(extra)
    return env


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtierd", *args], capture_output=True, text=True,
                          timeout=30, env=env)


class Serve:
    """``kvtierd serve`` with no flags (small sizes come from a config file, not from flags)."""

    def __init__(self, tmp_path: Path, env: dict[str, str]) -> None:
        config = tmp_path / "kvtierd.toml"
        config.write_text('cpu_bytes = "16MiB"\nnvme_bytes = "16MiB"\n'
                          'metrics_addr = "127.0.0.1:0"\n')
        self.env = {**env, "KVTIERD_CONFIG": str(config)}
        self.socket = paths.default_socket(self.env)
        self.log_path = tmp_path / "serve.log"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "kvtierd", "serve"], env=self.env,
                                         stdout=log, stderr=subprocess.STDOUT)
        wait_for(self._up, 30, "kvtierd serve answering")

    def _up(self) -> bool:
        assert self.proc.poll() is None, self.log()
        try:
            call(self.socket, Op.PING, timeout_s=0.5)
            return True
        except DaemonUnavailable:
            return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            assert self.proc.wait(timeout=30) == 0, self.log()
        assert "Traceback" not in self.log(), self.log()


def test_ping_and_stats_with_no_flags_find_serve_with_no_flags(tmp_path):
    env = private_env(tmp_path)
    daemon = Serve(tmp_path, env)
    try:
        assert daemon.socket == f"ipc://{tmp_path / 'run' / 'kvtierd' / 'kvtierd.sock'}"
        plain = {k: v for k, v in env.items() if k != "KVTIERD_CONFIG"}  # the CLI knows nothing
        result = cli("ping", env=plain)
        assert result.returncode == 0, result.stderr
        assert daemon.socket in result.stdout
        result = cli("stats", env=plain)
        assert result.returncode == 0, result.stderr
        assert f"socket  {daemon.socket}" in result.stdout
        # the client library and the vLLM spec resolve the same socket
        assert paths.client_socket(plain) == daemon.socket
        # the NVMe tier lives in a directory of this instance, under the private home
        nvme = tmp_path / "home" / ".local" / "state" / "kvtierd"
        assert [p.name for p in nvme.iterdir()] and (next(nvme.iterdir()) / "nvme").is_dir()
    finally:
        daemon.stop()
        for path in (tmp_path / "home").rglob("chunks.data"):
            path.unlink()


def test_ping_with_no_daemon_fails_at_once_saying_where_it_looked(tmp_path):
    env = private_env(tmp_path)
    result = cli("ping", env=env)
    assert result.returncode == 1, result.stderr
    assert "no kvtierd found" in result.stderr, result.stderr
    assert str(tmp_path / "run" / "kvtierd" / "kvtierd.sock") in result.stderr
    assert "/run/kvtierd/kvtierd.sock" in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_kubernetes_service_links_never_stop_serve_or_ping_and_a_typo_warns(tmp_path):
    env = private_env(tmp_path, **SERVICE_LINKS, KVTIERD_SESION_TIMEOUT_S="5")
    daemon = Serve(tmp_path, env)
    try:
        result = cli("ping", env=env)
        assert result.returncode == 0, result.stderr
        for out in (result.stderr, daemon.log()):
            assert "KVTIERD_SESION_TIMEOUT_S" in out and "KVTIERD_SESSION_TIMEOUT_S?" in out, out
            assert "KVTIERD_PORT" not in out and "KVTIERD_SERVICE" not in out, out
        assert "(default)" in daemon.log() and "session_timeout_s" in daemon.log()  # start log
    finally:
        daemon.stop()
        for path in (tmp_path / "home").rglob("chunks.data"):
            path.unlink()


def test_the_vllm_spec_defaults_to_the_same_socket(tmp_path, monkeypatch):
    from kvtier_client.vllm.settings import KVTierSettings

    env = private_env(tmp_path)
    (tmp_path / "run" / "kvtierd").mkdir()  # no daemon yet: the directory decides
    monkeypatch.setenv("XDG_RUNTIME_DIR", env["XDG_RUNTIME_DIR"])
    assert KVTierSettings.from_extra_config({}).address == paths.default_socket(env)
