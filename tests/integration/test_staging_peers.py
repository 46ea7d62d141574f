"""Issue 9: staging has no name another user could open, and the daemon learns who a session is
from the kernel (SO_PEERCRED), not from the client. Cross-user cases run a throwaway user B
(``useradd``, removed at the end) next to this test process as user A (root in CI)."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import socket
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers.daemon import DaemonProcess
from helpers.kv import (
    assert_chunk_equals,
    chunk_pages,
    poison,
    random_kv,
    random_tokens,
    simple_layout,
)

from kvtier_client import KVTierClient
from kvtier_client.index import KVTierIndex
from kvtierd.control import call
from kvtierd.protocol import Op

pytestmark = pytest.mark.timeout(90)

TESTS_DIR = Path(__file__).resolve().parent.parent
needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("useradd") is None,
                                reason="needs root and useradd (CI runs as root)")


def maps_of(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/maps").read_text().splitlines()


def test_live_session_has_no_staging_name_in_dev_shm(daemon):
    layout = simple_layout(page_bytes=8192)
    gen = torch.Generator().manual_seed(9)
    kv = random_kv(layout, [16], gen)
    chunks = layout.plan(random_tokens(gen, 128), [list(range(8))])
    with KVTierClient.connect(daemon.address, layout=layout, kv_caches=kv) as client:
        expected = {c.key: [p.clone() for p in chunk_pages(layout, kv, c)] for c in chunks}
        assert client.store(chunks).result(timeout=30) == [True] * len(chunks)
        me = os.getpid()
        assert not [p for p in Path("/dev/shm").iterdir()
                    if p.name.startswith("kvtier-") and str(me) in p.name]
        assert not [line for line in maps_of(me) if "/dev/shm/kvtier-" in line]
        fds = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}")]
        assert not [f for f in fds if f.startswith("/dev/shm/")], fds
        ours = [line for line in maps_of(daemon.proc.pid)
                if f"memfd:kvtier-staging-{me} " in line]
        assert len(ours) == 1, "the daemon maps our memfd, once"
        assert "/dev/shm" not in ours[0]
        poison(kv)
        assert client.load(chunks).result(timeout=30) == [True] * len(chunks)
        for chunk in chunks:
            assert_chunk_equals(layout, kv, chunk, expected[chunk.key], "load")
    assert f"peer uid {os.getuid()} gid {os.getgid()} pid {me}" in daemon.log()


# -- another user ----------------------------------------------------------------------------------
@pytest.fixture
def user_b(users) -> pwd.struct_passwd:
    return users()


def _daemon(root: Path, mode: str) -> DaemonProcess:
    d = DaemonProcess(root / f"d{mode}", [], env={"KVTIERD_SOCKET_MODE": mode}, nvme_bytes="0")
    d.workdir.chmod(0o700)  # private: the daemon adds the search bits socket_mode needs
    d.start()
    return d


B_SCRIPT = """
import json, os, sys
from helpers.handshake import MemfdBuffer, handshake_path, send_handshake
from helpers.raw import RawClient
from kvtierd.protocol import Op

uid, gid, address, a_pid = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
os.setgroups([])
os.setgid(gid)
os.setuid(uid)  # from here on this process is user B
out = {"uid": os.getuid(),
       "a_names": [n for n in os.listdir("/dev/shm") if n.startswith("kvtier-") and a_pid in n]}
raw = RawClient(address)
reply, _ = raw.request(Op.HELLO, namespace="b", rank=0, world_size=1, fingerprint="fp",
                       staging={"kind": "shm", "name": f"kvtier-stg-{a_pid}-x", "nbytes": 4096})
out["shm_hello"] = [reply["name"], reply["message"]]
buf = MemfdBuffer(65536)
buf.write(0, os.urandom(8192))
reply, _ = raw.request(Op.HELLO, namespace="b", rank=0, world_size=1, fingerprint="fp",
                       staging=buf.hello_staging(address))
out["own_hello"] = reply["name"]
reply, _ = raw.request(Op.PUT, items=[[b"b-key", 0, 8192]])
out["own_put"] = reply["results"]
raw.close()
print(json.dumps(out))
"""


def _run_as(user: pwd.struct_passwd, tmp: Path, address: str) -> dict:
    script = tmp / "as_b.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(TESTS_DIR)!r})\n"
                      + textwrap.dedent(B_SCRIPT))
    # started as root so that it can import from root-only paths, then it drops to B itself
    out = subprocess.run([sys.executable, str(script), str(user.pw_uid), str(user.pw_gid),
                          address, str(os.getpid())], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_root
def test_other_user_gets_no_staging_of_ours_and_the_daemon_knows_who_it_is(
        user_b, reachable_dir, tmp_path):
    d = _daemon(reachable_dir, "0666")
    try:
        layout = simple_layout(page_bytes=8192)
        gen = torch.Generator().manual_seed(10)
        kv = random_kv(layout, [16], gen)
        chunks = layout.plan(random_tokens(gen, 128), [list(range(8))])
        with KVTierClient.connect(d.address, layout=layout, kv_caches=kv) as client:
            expected = {c.key: [p.clone() for p in chunk_pages(layout, kv, c)] for c in chunks}
            assert client.store(chunks).result(timeout=30) == [True] * len(chunks)
            b = _run_as(user_b, tmp_path, d.address)
            assert b["uid"] == user_b.pw_uid
            assert b["a_names"] == [], "A's staging has a name B can see"
            assert b["shm_hello"][0] == "BAD_HANDLE", b
            assert "removed in protocol 2" in b["shm_hello"][1]
            assert b["own_hello"] == "OK" and b["own_put"] == [0], b
            poison(kv)
            assert client.load(chunks).result(timeout=30) == [True] * len(chunks)
            for chunk in chunks:
                assert_chunk_equals(layout, kv, chunk, expected[chunk.key], "load")
        log = d.log()
        assert f"peer uid {user_b.pw_uid} gid {user_b.pw_gid}" in log, log
        assert f"peer uid {os.getuid()} gid {os.getgid()} pid {os.getpid()}" in log
    finally:
        d.stop_and_verify()


@needs_root
def test_socket_mode_decides_who_may_connect(user_b, reachable_dir):
    for mode, others_may in (("0600", False), ("0666", True)):
        d = _daemon(reachable_dir, mode)
        try:
            ipc = Path(d.address[len("ipc://"):])
            hs = Path(str(ipc) + ".hs")
            for path in (ipc, hs):
                assert stat.S_IMODE(path.stat().st_mode) == int(mode, 8), (path, mode)
            assert stat.S_IMODE(ipc.parent.stat().st_mode) == (0o711 if others_may else 0o700)
            child = os.fork()
            if child == 0:  # user B tries the handshake socket
                code = 3
                try:
                    os.setgroups([])
                    os.setgid(user_b.pw_gid)
                    os.setuid(user_b.pw_uid)
                    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                        sock.settimeout(5)
                        sock.connect(str(hs))
                    code = 0
                except PermissionError:
                    code = 1
                finally:
                    os._exit(code)
            _, status = os.waitpid(child, 0)
            assert os.waitstatus_to_exitcode(status) == (0 if others_may else 1), mode
        finally:
            d.stop_and_verify()


def test_tcp_daemon_names_its_handshake_socket_in_ping(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    address, hs = f"tcp://127.0.0.1:{port}", tmp_path / "hs.sock"
    d = DaemonProcess(tmp_path / "tcp", ["--socket", address, "--handshake-socket", str(hs)])
    d.address = address  # the later --socket flag wins over the helper's ipc one
    d.start()
    try:
        assert call(address, Op.PING)["handshake"] == str(hs)
        assert stat.S_ISSOCK(hs.stat().st_mode) and stat.S_IMODE(hs.stat().st_mode) == 0o660
        layout = simple_layout(page_bytes=8192)
        gen = torch.Generator().manual_seed(11)
        kv = random_kv(layout, [16], gen)
        chunks = layout.plan(random_tokens(gen, 128), [list(range(8))])
        expected = {c.key: [p.clone() for p in chunk_pages(layout, kv, c)] for c in chunks}
        with KVTierClient.connect(address, layout=layout, kv_caches=kv) as client:
            assert client.store(chunks).result(timeout=30) == [True] * len(chunks)
            poison(kv)
            assert client.load(chunks).result(timeout=30) == [True] * len(chunks)
        for chunk in chunks:
            assert_chunk_equals(layout, kv, chunk, expected[chunk.key], "load")
        assert f"staging memfd:{client.staging_bytes}" in d.log()
    finally:
        d.stop_and_verify()
        d.remove_nvme_data()
    assert not hs.exists(), "the handshake socket outlived the daemon"


def test_scheduler_index_session_carries_the_same_credentials(daemon):
    index = KVTierIndex(daemon.address, namespace="idx", rank=0, fingerprint="fp-idx")
    try:
        assert index.lookup([b"nothing"]) == [0]
    finally:
        index.close()
    me = f"peer uid {os.getuid()} gid {os.getgid()} pid {os.getpid()}"
    # ... and so the same tenant as the workers of its uid
    assert (f"tenant uid:{os.getuid()} (uid {os.getuid()}) namespace idx rank 0/1 staging inline "
            f"{me}") in daemon.log(), daemon.log()
