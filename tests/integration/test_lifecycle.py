"""A daemon killed with -9 (OOM killer, container restart, PID 1 in a PID namespace) comes back by
itself: its arena is named per instance, guarded by its flock, and reclaimed by the next start;
a live daemon's arena is never touched."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.daemon import DaemonProcess
from helpers.handshake import inline_staging
from helpers.raw import RawClient
from helpers.wait import wait_for

from kvtierd.config import load_config
from kvtierd.control import DaemonUnavailable, call
from kvtierd.protocol import Op, Tier

SHM = Path("/dev/shm")
pytestmark = pytest.mark.timeout(120)


def test_kill9_then_another_start_reclaims_the_stale_arena_and_spares_a_live_one(tmp_path):
    live = DaemonProcess(tmp_path / "live", [])
    victim = DaemonProcess(tmp_path / "victim", [])
    third = DaemonProcess(tmp_path / "third", [])
    try:
        live.start()
        victim.start()
        victim.kill9()
        stale = SHM / victim.arena_name
        assert stale.exists(), "the killed daemon's arena should still be there (nobody reclaimed)"
        third.start()
        assert not stale.exists(), "a start did not reclaim the dead daemon's arena"
        assert victim.arena_name in third.log() and "reclaimed" in third.log(), third.log()
        assert (SHM / live.arena_name).exists(), "a live daemon's arena was touched"
        assert live.arena_name not in third.log()
        assert call(live.address, Op.PING)["status"] == 0
        live.check()
    finally:
        for d in (third, live, victim):
            d.stop_and_verify()
            d.remove_nvme_data()


def test_kill9_then_restart_of_the_same_daemon_comes_back_on_its_arena(tmp_path):
    d = DaemonProcess(tmp_path / "d", [])
    try:
        d.start()
        d.kill9()
        assert d.shm_files() == [SHM / d.arena_name]
        d.restart()  # same flags, same arena name: it must not fail with "File exists"
        assert "reclaimed the stale arena" in d.log(), d.log()
        assert d.cpu()["chunks"] == 0
    finally:
        d.stop_and_verify()
        d.remove_nvme_data()


def test_default_arena_name_is_stable_across_restarts_and_not_the_pid(tmp_path):
    socket = f"ipc://{tmp_path / 'kvtierd.sock'}"
    name = load_config(None, env={}, overrides={"socket": socket}).resolved_arena_name()
    assert name.startswith("kvtierd-") and str(os.getpid()) not in name
    flags = ["--socket", socket, "--cpu-bytes", "16MiB", "--metrics-addr", "off",
             "--nvme-bytes", "0"]
    env = {**_clean_env(), "XDG_STATE_HOME": str(tmp_path / "state")}
    for attempt in range(2):
        proc = _serve([sys.executable, "-m", "kvtierd", "serve", *flags], env,
                      tmp_path / f"serve-{attempt}.log")
        try:
            wait_for(lambda: _answers(socket), 30, "the daemon answering")
            assert (SHM / name).exists()
            assert call(socket, Op.STATS)["stats"]["daemon"]["pid"] == proc.pid
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
        assert (SHM / name).exists()  # killed: left behind, for the next start to reclaim
    _stop_one_more(socket, flags, env, tmp_path / "last.log")
    assert not (SHM / name).exists()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="needs root and util-linux unshare (CI runs as root)")
def test_pid1_in_a_pid_namespace_killed_with_9_comes_back_on_restart(tmp_path):
    """The container case: the daemon is PID 1 every time, so a pid-named arena crash-looped."""
    socket = f"ipc://{tmp_path / 'kvtierd.sock'}"
    name = load_config(None, env={}, overrides={"socket": socket}).resolved_arena_name()
    flags = ["--socket", socket, "--cpu-bytes", "16MiB", "--metrics-addr", "off",
             "--nvme-bytes", "0"]
    argv = ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-m", "kvtierd",
            "serve", *flags]
    env = _clean_env()
    logs = []
    try:
        for attempt in range(2):
            log_path = tmp_path / f"pid1-{attempt}.log"
            logs.append(log_path)
            outer = _serve(argv, env, log_path)
            try:
                wait_for(lambda: outer.poll() is not None or _answers(socket), 30, "PID 1 serving")
                assert outer.poll() is None, log_path.read_text()
                assert call(socket, Op.STATS)["stats"]["daemon"]["pid"] == 1  # really PID 1
                assert (SHM / name).exists()
                inner = _child_of(outer.pid)
                os.kill(inner, signal.SIGKILL)
                outer.wait(timeout=10)
            finally:
                if outer.poll() is None:
                    outer.kill()
                    outer.wait(timeout=10)
            assert (SHM / name).exists(), "a SIGKILLed daemon cannot have removed its arena"
        assert "reclaimed the stale arena" in logs[1].read_text(), logs[1].read_text()
    finally:
        _stop_one_more(socket, flags, env, tmp_path / "last.log")  # reclaims, stops cleanly
    assert not (SHM / name).exists()


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVTIERD_")}


def _answers(socket: str) -> bool:
    try:
        call(socket, Op.PING, timeout_s=0.5)
        return True
    except DaemonUnavailable:
        return False


def _child_of(pid: int) -> int:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


def _serve(argv: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "ab") as log:  # the child keeps its own descriptor
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)


def _stop_one_more(socket: str, flags: list[str], env: dict[str, str], log_path: Path) -> None:
    """Start the daemon once more (reclaiming what the kills left) and stop it with SIGTERM."""
    proc = _serve([sys.executable, "-m", "kvtierd", "serve", *flags], env, log_path)
    try:
        wait_for(lambda: proc.poll() is not None or _answers(socket), 30, "the last start")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode == 0, log_path.read_text()
    assert "reclaimed the stale arena" in log_path.read_text(), log_path.read_text()


def test_another_daemon_on_the_same_nvme_dir_is_refused_and_never_wipes_it(tmp_path):
    """The directory lock only keeps out a live daemon; a second instance started later (other
    socket, other page_bytes) used to reset the index and drop the first one's chunks."""
    first = DaemonProcess(tmp_path / "first", ["--nvme-write-policy", "write-through"])
    nvme_dir = first.workdir / "nvme"
    second = DaemonProcess(tmp_path / "second", ["--nvme-dir", str(nvme_dir)],
                           page_bytes="128KiB")
    payload = os.urandom(5000)
    try:
        first.start()
        raw = RawClient(first.address)
        try:
            reply, _ = raw.request(Op.HELLO, namespace="owner", rank=0, world_size=1, fingerprint="fp",
                                   staging=inline_staging(first.address))
            assert reply["name"] == "OK", reply
            reply, _ = raw.request(Op.PUT, [payload], items=[[b"kept", 0, len(payload)]])
            assert reply["results"] == [0], reply
        finally:
            raw.close()
        wait_for(lambda: first.stats()["tiers"]["nvme"]["chunks"] == 1, 30, "the NVMe write")
        first.stop_and_verify()
        with pytest.raises(RuntimeError, match="exited with 1") as info:
            second.start()
        assert "nvme_dir" in str(info.value) and "instance" in str(info.value), info.value
        first.restart()
        raw = RawClient(first.address)
        try:
            raw.request(Op.HELLO, namespace="owner", rank=0, world_size=1, fingerprint="fp",
                        staging=inline_staging(first.address))
            reply, _ = raw.request(Op.LOOKUP, keys=[b"kept"])
            assert reply["tiers"] == [Tier.NVME], reply
            reply, frames = raw.request(Op.GET, items=[[b"kept", 0, len(payload)]])
            assert reply["results"] == [0] and frames == [payload], reply
        finally:
            raw.close()
    finally:
        for d in (second, first):
            d.stop_and_verify()
            d.remove_nvme_data()
