"""Issue 33, the trust boundary's second round: five attacks of one local process with no
privileges beyond its uid, replayed against a real daemon. Before the fix each one aborted the
daemon, got it killed or crossed tenants; now each is refused with a reason, the daemon keeps
serving a bystander whose chunk stays byte-exact, and CHECK stays clean.

1. descriptor hoarding in the staging handshake (fds trickled with 1-byte sendmsg calls);
2. a hugetlb memfd as staging (its huge page punched out and reused: SIGBUS);
3. a client punching holes in its staging after the handshake, so that the daemon's GETs fault
   its memory in, charged to the daemon's memory cgroup (OOM kill);
4. (in test_trust_userns.py) a daemon in a user namespace merging every unmapped user into
   ``uid:65534``;
5. a process reconnecting with a closed connection's routing id to take over its session.

And the smaller gaps: handshake messages that are not exactly one map of the integer version,
the anonymous tenant on ipc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import mmap
import os
import secrets
import select
import socket
import time
from pathlib import Path

import msgpack
import pytest
from helpers.bad_input import bystander, names
from helpers.daemon import DaemonProcess
from helpers.handshake import (
    SEALED,
    MemfdBuffer,
    handshake,
    handshake_path,
    inline_staging,
    send_handshake,
)
from helpers.kernel import huge_pages, memory_cgroup, open_fds
from helpers.raw import RawClient

from kvtier_client.handshake import connect
from kvtierd.control import call
from kvtierd.protocol import PROTOCOL_VERSION, Op

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (huge pages, cgroups; CI runs as root)"),
]

MiB = 1024**2
KEEP_SIZE, PUNCH_HOLE = 0x1, 0x2  # FALLOC_FL_*
MADV_REMOVE = 9
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def _hello(raw: RawClient, staging: dict, namespace: str = "", **extra) -> dict:
    reply, _ = raw.request(Op.HELLO, namespace=namespace or f"tb-{secrets.token_hex(4)}", rank=0,
                           world_size=1, fingerprint="fp-tb", staging=staging, **extra)
    return reply


# -- 1. descriptor hoarding ------------------------------------------------------------------------
def _trickle_descriptors(path: str, fds: list[int], sends: int) -> tuple[dict | None, int]:
    """The attack: the prefix of a handshake map whose last value is a 4,090-byte bin32, then
    up to ``sends`` 1-byte sendmsg calls each carrying ``fds``. Returns the daemon's answer (None
    if it never answered) and how many of the sends the kernel took."""
    prefix = (b"\x84" + msgpack.packb("v") + msgpack.packb(PROTOCOL_VERSION)
              + msgpack.packb("kind") + msgpack.packb("memfd") + msgpack.packb("nbytes")
              + msgpack.packb(4096) + msgpack.packb("pad") + b"\xc6" + (4090).to_bytes(4, "big"))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        connect(sock, path, 5.0)
        sock.sendall(prefix)
        taken = 0
        for _ in range(sends):
            if select.select([sock], [], [], 0)[0]:
                break  # the daemon answered
            try:
                socket.send_fds(sock, [b"x"], fds, socket.MSG_DONTWAIT)
            except BlockingIOError:
                time.sleep(0.001)  # the daemon is slow to read: wait, the fds stay queued
                continue
            except OSError:  # EPIPE / ECONNRESET: the daemon closed the connection
                break
            taken += 1
        sock.settimeout(5.0)
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except OSError:
            pass
    return (msgpack.unpackb(answer, raw=False) if answer else None), taken


def test_descriptor_hoarding_is_refused_at_the_second_descriptor(daemon, memfd):
    pid = daemon.proc.pid
    path = handshake_path(daemon.address)
    nulls = [os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC) for _ in range(4)]
    try:
        with bystander(daemon, memfd):
            base = open_fds(pid)
            peak = base
            for _ in range(5):  # with LimitNOFILE=65536, 5 such connections aborted the daemon
                answer, taken = _trickle_descriptors(path, nulls, 3000)
                peak = max(peak, open_fds(pid))
                assert answer is not None and answer["name"] == "BAD_HANDLE", (answer, taken)
                assert "more than 1 file descriptor" in answer["message"], answer
            assert peak < base + 32, f"the daemon held {peak - base} descriptors more"
            assert open_fds(pid) <= base + 4  # everything it received is closed again
            raw = RawClient(daemon.address)  # a new ZeroMQ connection (libzmq's accept)
            try:
                assert _hello(raw, inline_staging(daemon.address))["name"] == "OK"
            finally:
                raw.close()
    finally:
        for fd in nulls:
            os.close(fd)


def test_a_well_formed_memfd_handshake_with_one_extra_descriptor_is_refused(daemon, memfd):
    buf = memfd(64 * 1024)
    extra = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
    try:
        answer = handshake(handshake_path(daemon.address), "memfd", buf.nbytes, [buf.fd, extra])
    finally:
        os.close(extra)
    assert answer["name"] == "BAD_HANDLE" and "more than 1 file descriptor" in answer["message"]


# -- 2. hugetlb staging ----------------------------------------------------------------------------
def test_a_hugetlb_memfd_is_refused_before_the_daemon_maps_it(daemon, memfd):
    with huge_pages(2) as huge, bystander(daemon, memfd):
        fd = os.memfd_create("kvtier-test-huge", os.MFD_HUGETLB | os.MFD_ALLOW_SEALING
                             | os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, huge)
            with mmap.mmap(fd, huge, flags=mmap.MAP_SHARED) as mapped:  # allocated and written
                mapped[:] = os.urandom(huge)
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALED)
                assert os.lseek(fd, 0, os.SEEK_HOLE) == huge  # passes every other check
                answer = handshake(handshake_path(daemon.address), "memfd", huge, [fd])
                maps = Path(f"/proc/{daemon.proc.pid}/maps").read_text()
        finally:
            os.close(fd)
        assert answer["name"] == "BAD_HANDLE", answer
        assert "hugetlbfs" in answer["message"] and "MFD_HUGETLB" in answer["message"], answer
        assert "kvtier-test-huge" not in maps, "the daemon mapped the hugetlb memfd"


# -- 3. holes punched after the handshake ----------------------------------------------------------
def test_a_client_cannot_punch_its_staging_so_the_daemon_is_never_charged_nor_oom_killed(
        daemon_factory):
    d = daemon_factory(cpu_bytes="64MiB", page_bytes="1MiB", nvme_bytes="0")
    staging, chunk, gets = 512 * MiB, 8 * MiB, 30
    buf = MemfdBuffer(staging)
    raw = RawClient(d.address)
    try:
        assert _hello(raw, buf.hello_staging(d.address))["name"] == "OK"
        data = os.urandom(chunk)
        buf.write(0, data)
        assert names(raw.request(Op.PUT, items=[[b"k", 0, chunk]])[0]["results"]) == ["OK"]
        # The daemon sealed the buffer F_SEAL_FUTURE_WRITE | F_SEAL_SEAL once it had mapped it.
        assert fcntl.fcntl(buf.fd, fcntl.F_GET_SEALS) & 0x11 == 0x11
        with memory_cgroup() as cgroup:
            cgroup.add(d.proc.pid)
            before = cgroup.usage()
            cgroup.limit(before + 160 * MiB)
            # the attack: free the client's pages, so that the daemon's writes allocate them
            assert _libc.fallocate(buf.fd, PUNCH_HOLE | KEEP_SIZE, 0, staging) == -1
            assert ctypes.get_errno() == errno.EPERM
            assert _libc.madvise(buf.address, staging, MADV_REMOVE) == -1
            assert ctypes.get_errno() == errno.EPERM
            assert os.lseek(buf.fd, 0, os.SEEK_HOLE) == staging, "a page was punched out"
            for i in range(1, gets + 1):  # 240 MiB of GETs into the range the attack aimed at
                offset = (i * chunk) % staging
                buf.fill(0xEE, offset, offset + chunk)
                reply, _ = raw.request(Op.GET, items=[[b"k", offset, chunk]])
                assert names(reply["results"]) == ["OK"], reply
                assert buf.read(offset, chunk) == data
            grown = cgroup.usage() - before
            assert d.alive(), f"the daemon died:\n{d.log()}"
            assert cgroup.oom_kills() == 0
            assert grown < 32 * MiB, f"the daemon was charged {grown} bytes by the GETs"
            (cgroup.path.parent / "cgroup.procs").write_text(str(d.proc.pid))  # back out
        d.check()
    finally:
        raw.close()
        buf.close()


def test_a_memfd_sealed_f_seal_seal_by_the_client_is_refused_naming_why(daemon, memfd):
    buf = memfd(64 * 1024, seals=SEALED | fcntl.F_SEAL_SEAL)
    answer = handshake(handshake_path(daemon.address), "memfd", buf.nbytes, [buf.fd])
    assert answer["name"] == "BAD_HANDLE", answer
    assert "F_SEAL_SEAL (the daemon adds F_SEAL_FUTURE_WRITE" in answer["message"], answer


# -- 5. session takeover by routing id -------------------------------------------------------------
def _probe_as(sock, ops: list[dict], window_s: float) -> list[dict]:
    """Send ``ops`` (request headers) over and over for ``window_s`` and collect every reply
    (libzmq may drop the first messages of a connection whose routing id is still taken)."""
    replies, request_id = [], 0
    deadline = time.monotonic() + window_s
    while time.monotonic() < deadline:
        for op in ops:
            request_id += 1
            sock.send(msgpack.packb({"v": PROTOCOL_VERSION, "id": request_id, **op}))
        while sock.poll(50):
            parts = sock.recv_multipart()
            header = msgpack.unpackb(parts[0], raw=False)
            if header.get("id"):
                replies.append({**header, "frames": parts[1:]})
    return replies


def test_a_reconnect_with_a_closed_sessions_routing_id_does_not_inherit_it(daemon_factory,
                                                                           tmp_path):
    import zmq

    config = tmp_path / "tenants.toml"
    config.write_text('[tenants.team-a]\ntokens = ["tok-a"]\n')
    d = daemon_factory("--config", str(config))
    victim = b"victim-" + secrets.token_bytes(8)
    data = os.urandom(100_000)
    a = RawClient(d.address, routing_id=victim)
    reply = _hello(a, inline_staging(d.address), token="tok-a", namespace="victims")
    assert reply["name"] == "OK" and len(reply["secret"]) == 16, reply
    reply, _ = a.request(Op.PUT, [data], items=[[b"secret-prompt", 0, len(data)]])
    assert names(reply["results"]) == ["OK"], reply
    a.close()  # gone without BYE: its session lives until the daemon notices
    ops = [{"op": int(Op.LOOKUP), "keys": [b"secret-prompt"]},
           {"op": int(Op.GET), "items": [[b"secret-prompt", 0, len(data)]]},
           {"op": int(Op.LOOKUP), "keys": [b"secret-prompt"], "secret": secrets.token_bytes(16)},
           {"op": int(Op.GET), "items": [[b"secret-prompt", 0, len(data)]], "secret": b""}]
    replies: list[dict] = []
    deadline = time.monotonic() + 15
    while not replies and time.monotonic() < deadline:
        # libzmq drops a connection's messages while its routing id is still A's; B reconnects
        # and tries again, as the attacker did (about 35 tries), through A's session's lifetime
        b = zmq.Context.instance().socket(zmq.DEALER)
        b.setsockopt(zmq.LINGER, 0)
        b.setsockopt(zmq.ROUTING_ID, victim)
        b.connect(d.address)
        try:
            replies = _probe_as(b, ops, 1.0)
        finally:
            b.close(linger=0)
    assert replies, "B's requests were never answered"
    assert {r["name"] for r in replies} == {"NO_SESSION"}, [r for r in replies
                                                            if r["name"] != "NO_SESSION"][:3]
    assert not any(data in r["frames"] for r in replies), "B read A's bytes through A's session"
    # A's chunk is intact for A's tenant, and nobody else's
    owner, stranger = RawClient(d.address), RawClient(d.address)
    try:
        assert _hello(owner, inline_staging(d.address), token="tok-a",
                      namespace="victims")["name"] == "OK"
        reply, frames = owner.request(Op.GET, items=[[b"secret-prompt", 0, len(data)]])
        assert names(reply["results"]) == ["OK"] and frames == [data], reply
        assert _hello(stranger, inline_staging(d.address), namespace="victims")["name"] == "OK"
        assert stranger.request(Op.LOOKUP, keys=[b"secret-prompt"])[0]["tiers"] == [0]
    finally:
        owner.close()
        stranger.close()
    d.check()


def test_every_request_of_a_session_needs_its_secret(daemon):
    raw = RawClient(daemon.address)
    try:
        reply = _hello(raw, inline_staging(daemon.address))
        assert reply["name"] == "OK"
        secret = reply["secret"]
        for wrong in (None, b"", secret[:-1] + bytes([secret[-1] ^ 1]), "text", 7):
            answer, _ = raw.request(Op.LOOKUP, keys=[b"x"], secret=wrong)
            assert answer["name"] == "NO_SESSION", (wrong, answer)
        assert raw.request(Op.LOOKUP, keys=[b"x"])[0]["tiers"] == [0]  # the right one
        assert raw.request(Op.BYE, secret=None)[0]["name"] == "NO_SESSION"
        assert raw.request(Op.BYE)[0]["name"] == "OK"
        metrics = daemon.metrics_text()
        assert 'kvtierd_refused_total{reason="secret"} 6.0' in metrics
    finally:
        raw.close()


# -- the handshake message itself ------------------------------------------------------------------
@pytest.mark.parametrize("data, status, fragment", [
    (msgpack.packb({"v": float(PROTOCOL_VERSION), "kind": "inline", "nbytes": 0}),
     "UNSUPPORTED_VERSION", "(the integer)"),
    (msgpack.packb({"v": True, "kind": "inline", "nbytes": 0}), "UNSUPPORTED_VERSION", "True"),
    (msgpack.packb({"v": PROTOCOL_VERSION - 1, "kind": "inline", "nbytes": 0}),
     "UNSUPPORTED_VERSION", f"speaks {PROTOCOL_VERSION}"),
    (msgpack.packb({"v": PROTOCOL_VERSION, "kind": "inline", "nbytes": 0}) + b"\x00",
     "BAD_MESSAGE", "1 byte(s) follow the handshake map"),
    (msgpack.packb({"v": PROTOCOL_VERSION, "kind": "inline", "nbytes": 0}) * 2,
     "BAD_MESSAGE", "follow the handshake map"),
], ids=["v-float", "v-bool", "v-older", "trailing-byte", "two-maps"])
def test_the_handshake_is_exactly_one_map_of_the_integer_version(daemon, data, status, fragment):
    answer = send_handshake(handshake_path(daemon.address), data)
    assert answer["name"] == status and fragment in answer["message"], answer
    assert daemon.alive()


# -- the anonymous tenant --------------------------------------------------------------------------
def test_an_ipc_daemon_refuses_the_anonymous_tenant_unless_configured(daemon_factory):
    refusing, allowing = daemon_factory(), daemon_factory("--anonymous-tenant", "allow")
    for d, expected in ((refusing, "AUTH_FAILED"), (allowing, "OK")):
        raw = RawClient(d.address)
        try:
            reply = _hello(raw, {"kind": "inline"})  # no ticket: no credentials
            assert reply["name"] == expected, reply
            if expected != "OK":
                assert "anonymous_tenant" in reply["message"] and ".hs" in reply["message"]
                assert 'kvtierd_refused_total{reason="anonymous"} 1.0' in d.metrics_text()
            assert _hello(raw, inline_staging(d.address))["name"] == "OK"  # with credentials
        finally:
            raw.close()


def test_a_daemon_answers_others_while_one_process_hoards_and_probes(daemon, memfd):
    """All of the above from one process in a row, against one daemon that must keep serving."""
    path = handshake_path(daemon.address)
    nulls = [os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC) for _ in range(4)]
    try:
        with bystander(daemon, memfd):
            _trickle_descriptors(path, nulls, 500)
            bad = memfd(64 * 1024, seals=SEALED | fcntl.F_SEAL_SEAL)
            assert handshake(path, "memfd", bad.nbytes, [bad.fd])["name"] == "BAD_HANDLE"
            send_handshake(path, b"\x81\xa1v\xcb" + b"\x00" * 8)  # v: 0.0
            raw = RawClient(daemon.address)
            try:
                assert raw.request(Op.LOOKUP, keys=[b"x"])[0]["name"] == "NO_SESSION"
            finally:
                raw.close()
    finally:
        for fd in nulls:
            os.close(fd)



# -- per-tenant figures ----------------------------------------------------------------------------
def _scrape(d: DaemonProcess, token: str = "") -> str:
    import urllib.request

    url = call(d.address, Op.STATS, token=d.token)["stats"]["daemon"]["metrics"]
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=5) as resp:
        return resp.read().decode()


def _store_as_tenant(d: DaemonProcess, token: str) -> None:
    raw = RawClient(d.address)
    try:
        assert _hello(raw, inline_staging(d.address), token=token)["name"] == "OK"
        reply, _ = raw.request(Op.PUT, [os.urandom(70_000)], items=[[b"t", 0, 70_000]])
        assert names(reply["results"]) == ["OK"], reply
    finally:
        raw.close()


def test_per_tenant_figures_need_the_admin_token_and_aggregates_stay_open(daemon_factory,
                                                                            tmp_path):
    tenants = '[tenants.team-a]\ntokens = ["tok-a"]\n'
    (tmp_path / "open.toml").write_text(tenants)
    (tmp_path / "admin.toml").write_text(f'admin_token = "adm-1"\n{tenants}')
    plain = daemon_factory("--config", str(tmp_path / "open.toml"))
    admin = daemon_factory("--config", str(tmp_path / "admin.toml"))
    exposed = daemon_factory("--config", str(tmp_path / "open.toml"), "--expose-tenant-stats")
    for d in (plain, admin, exposed):
        _store_as_tenant(d, "tok-a")
    # no token configured: STATS answers anyone, without tenants; /metrics without tenant series
    stats = call(plain.address, Op.STATS)["stats"]
    assert "tenants" not in stats and "admin_token" in stats["tenants_hidden"], stats.keys()
    assert stats["tiers"]["cpu"]["chunks"] == 1  # aggregates stay open
    text = _scrape(plain, "anything")
    assert "kvtierd_tier_used_bytes" in text and "kvtierd_tenant_used_bytes" not in text
    assert "kvtierd_quota_rejections_total" not in text
    # admin_token: STATS with it shows the rows; a scrape shows them only with it as bearer
    stats = call(admin.address, Op.STATS, token="adm-1")["stats"]
    assert stats["tenants"]["team-a"]["used_bytes"] == 2 * 64 * 1024, stats["tenants"]
    assert "kvtierd_tenant_used_bytes" not in _scrape(admin)
    assert "kvtierd_tenant_used_bytes" not in _scrape(admin, "adm-2")
    text = _scrape(admin, "adm-1")
    assert 'kvtierd_tenant_used_bytes{tenant="team-a"} 131072.0' in text
    assert 'kvtierd_quota_rejections_total{tenant="team-a"} 0.0' in text
    assert "kvtierd_tier_used_bytes" in text
    # the operator opted in: everyone sees them
    assert call(exposed.address, Op.STATS)["stats"]["tenants"]["team-a"]["used_bytes"] > 0
    assert 'kvtierd_tenant_used_bytes{tenant="team-a"}' in _scrape(exposed)
