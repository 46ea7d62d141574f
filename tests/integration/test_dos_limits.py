"""Denial of service by an unauthenticated local peer, each attack tried against a real daemon:
connection churn, connections past RLIMIT_NOFILE, inline GET amplification, HELLO spam and
pipelined batches. The daemon must stay alive and keep serving everyone else."""

from __future__ import annotations

import os
import resource
import socket as pysocket
import time
from pathlib import Path

import msgpack
import pytest
import zmq
from helpers.bad_input import Session, names, namespace, write_toml
from helpers.metrics import sample
from helpers.handshake import inline_staging
from helpers.raw import RawClient
from helpers.wait import wait_for

from kvtierd.protocol import PROTOCOL_VERSION, Op
from kvtierd.server.connections import ConnectionGuard

pytestmark = pytest.mark.timeout(120)

MIB = 1024**2


def _rss_peak_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc status")


def _ping_counting_notices(raw: RawClient) -> int:
    """PING an idle peer's socket; return how many probe notices (id 0) were queued before it."""
    request_id = 777_000 + int(time.monotonic_ns() % 1000)
    raw.send_frames([msgpack.packb({"v": PROTOCOL_VERSION, "op": int(Op.PING), "id": request_id})])
    notices = 0
    while True:
        assert raw.sock.poll(10_000), "the idle session's PING was not answered"
        header = msgpack.unpackb(raw.sock.recv_multipart()[0], raw=False)
        if header["id"] == request_id:
            assert header["name"] == "OK", header
            return notices
        assert header["id"] == 0, header
        notices += 1


def test_connect_close_churn_20000_keeps_idle_session_answered(daemon):
    # ``watcher`` PINGs every 5,000 cycles; ``idle`` says nothing during all 20,000 of them
    watcher, idle = Session(daemon.address, namespace()), Session(daemon.address, namespace())
    data = os.urandom(300_000)
    try:
        assert names(idle.put([[b"idle-chunk", 0, len(data)]], [data])["results"]) == ["OK"]
        path = daemon.address[len("ipc://"):]
        for cycle in range(20_000):
            conn = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
            conn.connect(path)
            conn.close()
            if cycle % 5_000 == 4_999:
                _ping_counting_notices(watcher.raw)
        notices = _ping_counting_notices(idle.raw)
        # coalesced: far fewer notices than disconnects (there were 1 to 3 per disconnect, and
        # past SNDHWM = 10,000 queued messages the PING reply was dropped)
        assert notices < 10_000, notices
        reply, payload = idle.get([[b"idle-chunk", 0, len(data)]])
        assert names(reply["results"]) == ["OK"] and payload == [data]
        assert daemon.stats()["sessions"] >= 2
    finally:
        watcher.close()
        idle.close()


def _nofile_1024() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))


@pytest.fixture
def many_fds():
    """Raise this process's RLIMIT_NOFILE so that it can hold 1,100 DEALER sockets."""
    saved = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 8192
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, max(want, saved[1])))
    except (ValueError, OSError) as exc:
        pytest.skip(f"cannot raise RLIMIT_NOFILE to {want} for the test client: {exc}")
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, saved)


def _connect_until_refused(path: Path, count: int) -> list[pysocket.socket]:
    """``count`` raw connections to ``path``, each read until the daemon shuts it down (EOF)."""
    conns = []
    for _ in range(count):
        conn = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
        conns.append(conn)
        conn.settimeout(30)
        conn.connect(str(path))
        while conn.recv(4096):  # libzmq's greeting may come first; the refusal is EOF
            pass
    return conns


def test_connections_past_rlimit_nofile_do_not_abort(daemon_factory, many_fds):
    # one uid's crowd: the per-uid cap lifted to the global one, whose mechanism this tests
    # (test_trust_users tests the per-uid cap)
    d = daemon_factory(preexec_fn=_nofile_1024, env={"KVTIERD_MAX_CONNECTIONS_PER_UID": "100000"})
    metrics_url = d.stats()["daemon"]["metrics"]
    old = Session(d.address, namespace())
    data = os.urandom(200_000)
    ctx = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, 2048)
    crowd: list[zmq.Socket] = []
    try:
        assert names(old.put([[b"old-chunk", 0, len(data)]], [data])["results"]) == ["OK"]
        for _ in range(1_100):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(d.address)
            crowd.append(sock)
        # at the cap the socket file is hidden; how many of the crowd arrived before that (and
        # were refused) depends on how fast the guard thread reacted, possibly none
        hidden = ConnectionGuard.hidden_path(Path(d.address[len("ipc://"):]))
        wait_for(hidden.exists, 30, f"{hidden} hidden at max_connections")
        # a peer that connects to the hidden name is accepted by libzmq and refused at once
        for conn in _connect_until_refused(hidden, 8):
            conn.close()
        wait_for(lambda: sample(metrics_url, "kvtierd_refused_total", reason="connections") >= 8,
                 30, "connections past max_connections counted as refused")
        assert d.alive(), d.log()
        fds = len(os.listdir(f"/proc/{d.proc.pid}/fd"))
        assert fds < 1024, fds
        # the established session is still served, byte-exact
        assert old.request(Op.PING)[0]["name"] == "OK"
        reply, payload = old.get([[b"old-chunk", 0, len(data)]])
        assert names(reply["results"]) == ["OK"] and payload == [data]
        assert "Too many open files" not in d.log()
        for sock in crowd:
            sock.close()
        crowd.clear()

        def new_one_served() -> bool:
            raw = RawClient(d.address, timeout_s=1.0)
            try:
                raw.request(Op.PING)
                return True
            except AssertionError:
                return False
            finally:
                raw.close()

        wait_for(new_one_served, 60, "a new connection served once the crowd closed")
        assert d.alive(), d.log()
        connections = d.stats()["connections"]
        assert connections["max"] == (1024 - 256) // 3 and connections["refused"] > 0, connections
        assert not connections["hidden"], connections
    finally:
        for sock in crowd:
            sock.close()
        ctx.term()
        old.close()


def test_inline_get_amplification_is_bounded(daemon_factory):
    d = daemon_factory(cpu_bytes="32MiB", nvme_bytes="0")
    s = Session(d.address, namespace())
    chunk = os.urandom(8 * MIB)
    try:
        assert names(s.put([[b"big", 0, len(chunk)]], [chunk])["results"]) == ["OK"]
        before = _rss_peak_bytes(d.proc.pid)
        header_items = [[b"big", 0, len(chunk)]] * 128  # one ~1.5 KB request, 1 GiB of replies
        assert len(msgpack.packb(header_items)) < 2048
        reply, payload = s.get(header_items)
        grown = _rss_peak_bytes(d.proc.pid) - before
        assert grown < 256 * MIB, f"peak RSS grew by {grown / MIB:.0f} MiB"
        ok = [i for i, r in enumerate(names(reply["results"])) if r == "OK"]
        assert len(ok) == 8, names(reply["results"])  # 64 MiB of 8 MiB items
        assert all(payload[i] == chunk for i in ok)
        assert set(names(reply["results"])) == {"OK", "TOO_LARGE"}
        assert all(p == b"" for i, p in enumerate(payload) if i not in ok)
        index, name, message = reply["errors"][0]
        assert name == "TOO_LARGE" and "max_inline_reply_bytes (67108864)" in message, message
        # the budget comes back once the reply was sent
        reply, payload = s.get([[b"big", 0, len(chunk)]] * 2)
        assert names(reply["results"]) == ["OK", "OK"] and payload == [chunk, chunk]
        metrics_url = d.stats()["daemon"]["metrics"]
        assert sample(metrics_url, "kvtierd_refused_total", reason="inline_reply_bytes") == 120
    finally:
        s.close()


def test_hello_spam_past_max_sessions_is_busy(daemon_factory, tmp_path):
    # max_sessions_per_uid as the global cap: this tests the global one (test_trust_users the
    # per-uid one)
    config = write_toml(tmp_path / "sessions.toml", "max_sessions = 2\nmax_sessions_per_uid = 2\n")
    d = daemon_factory("--config", str(config))
    first, second = Session(d.address, namespace()), Session(d.address, namespace())
    spam = RawClient(d.address)
    try:
        hello = dict(namespace=namespace(), rank=0, world_size=1, fingerprint="fp",
                     staging={"kind": "inline"})  # refused before the staging is looked at
        for _ in range(3):
            reply, _ = spam.request(Op.HELLO, **hello)
            assert reply["name"] == "BUSY", reply
            assert "max_sessions is 2" in reply["message"], reply
        assert d.stats()["sessions"] == 2
        # an existing session may say HELLO again (it replaces itself)
        hello["staging"] = inline_staging(d.address)
        assert first.request(Op.HELLO, **hello)[0]["name"] == "OK"
        assert second.request(Op.BYE)[0]["name"] == "OK"
        hello["staging"] = inline_staging(d.address)
        assert spam.request(Op.HELLO, **hello)[0]["name"] == "OK"
        assert spam.request(Op.LOOKUP, keys=[b"k"])[0]["name"] == "OK"
    finally:
        spam.close()
        first.close()
        second.close()


def test_pipelined_batches_past_max_in_flight_are_busy(daemon_factory, tmp_path):
    config = write_toml(tmp_path / "in-flight.toml", "max_in_flight_requests = 1\n")
    d = daemon_factory("--config", str(config), cpu_bytes="64MiB", nvme_bytes="0")
    s = Session(d.address, namespace())
    big = os.urandom(16 * MIB)  # copied on a copy thread: its batch stays in flight a while
    small = os.urandom(1000)
    busy_seen = []
    try:
        for rnd in range(5):
            key = b"big-%d" % rnd
            headers = [{"v": PROTOCOL_VERSION, "op": int(Op.PUT), "id": 100 * rnd + 1,
                        "secret": s.raw.secret, "items": [[key, 0, len(big)]]}]
            headers += [{"v": PROTOCOL_VERSION, "op": int(Op.PUT), "id": 100 * rnd + 2 + i,
                         "secret": s.raw.secret, "items": [[b"small-%d-%d" % (rnd, i), 0, len(small)]]} for i in range(4)]
            s.raw.send_frames([msgpack.packb(headers[0]), big])
            for h in headers[1:]:
                s.raw.send_frames([msgpack.packb(h), small])
            replies = {}
            while len(replies) < len(headers):
                reply, _ = s.raw.recv()
                replies[reply["id"]] = reply
            assert names(replies[100 * rnd + 1]["results"]) == ["OK"]  # the first is never refused
            for rid, reply in replies.items():
                if reply["name"] == "BUSY":
                    assert "max_in_flight_requests is 1" in reply["message"], reply
                    busy_seen.append(rid)
                else:
                    assert reply["name"] == "OK" and names(reply["results"]) == ["OK"], reply
            assert s.request(Op.DELETE, keys=[key])[0]["name"] == "OK"
            if busy_seen:
                break
        assert busy_seen, "no PUT was refused while a 16 MiB batch was in flight"
        assert s.lookup([b"big-0"]) == [0]
        reply, payload = s.get([[b"small-0-0", 0, len(small)]])  # refused ones left no trace
        if 2 in busy_seen:
            assert names(reply["results"]) == ["MISS"]
        else:
            assert payload == [small]
    finally:
        s.close()
