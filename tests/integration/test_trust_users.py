"""Issue 33 with real users (throwaway ``useradd`` users, removed at the end): a daemon in a user
namespace must not merge the users it cannot tell apart into one tenant, and one user cannot take
every session or connection from another."""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path

import pytest
from helpers.as_users import run_as
from helpers.daemon import DaemonProcess
from helpers.handshake import inline_staging
from helpers.metrics import sample
from helpers.raw import RawClient
from helpers.wait import wait_for

from kvtierd.protocol import Op

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("useradd") is None
                       or shutil.which("unshare") is None,
                       reason="needs root, useradd and unshare (CI runs as root)"),
]

KEYS = [f"prefix-{i}" for i in range(3)]
USERNS_LAUNCHER = ["unshare", "--user", "--map-root-user", sys.executable, "-m", "kvtierd",
                   "serve"]


def _start(root, name, config: str = "", launcher=None, env=None) -> DaemonProcess:
    flags = []
    if config:
        path = root / f"{name}.toml"
        path.write_text(config)
        flags = ["--config", str(path)]
    d = DaemonProcess(root / name, flags, env={"KVTIERD_SOCKET_MODE": "0666", **(env or {})},
                      nvme_bytes="0", launcher=launcher)
    d.workdir.chmod(0o700)  # the daemon adds the search bits socket_mode needs
    d.start()
    return d


# -- 4. user namespaces ----------------------------------------------------------------------------
def test_in_a_user_namespace_unmapped_users_are_refused_not_merged(users, reachable_dir):
    a, b = users(), users()
    d = _start(reachable_dir, "userns", '[tenants.team-a]\ntokens = ["tok-a"]\n',
               launcher=USERNS_LAUNCHER)
    try:
        (hello_a, put_a), (hello_b, lookup_b, get_b), (hello_t, put_t), (hello_b2, lookup_b2) = \
            run_as(d.address, d.workdir, KEYS,
                   (a, [{"op": "hello"}, {"op": "put", "seed": "a"}]),
                   (b, [{"op": "hello"}, {"op": "lookup"}, {"op": "get", "seed": "a"}]),
                   (a, [{"op": "hello", "token": "tok-a"}, {"op": "put", "seed": "a"}]),
                   (b, [{"op": "hello"}, {"op": "lookup"}]))
        # Before: both were tenant uid:65534 and B read A's chunks byte for byte.
        for name, message in (hello_a, hello_b, hello_b2):
            assert name == "AUTH_FAILED", (name, message)
            assert "not mapped into the daemon's user namespace" in message, message
            assert "uid 65534" in message
        assert put_a == "NO_SESSION" and lookup_b == "NO_SESSION" and lookup_b2 == "NO_SESSION"
        assert get_b["name"] == "NO_SESSION" and get_b["untouched"] == [True] * len(KEYS)
        assert hello_t[0] == "OK" and put_t == ["OK"] * len(KEYS)  # a tenant token says who
        # root is mapped (0 -> 0): it keeps its own tenant
        raw = RawClient(d.address)
        try:
            reply, _ = raw.request(Op.HELLO, namespace="same-model", rank=0, world_size=1,
                                   fingerprint="same-layout", staging=inline_staging(d.address))
            assert reply["name"] == "OK", reply
            assert raw.request(Op.LOOKUP, keys=[k.encode() for k in KEYS])[0]["tiers"] == [0] * 3
        finally:
            raw.close()
        log = d.log()
        assert "outside the initial user namespace" in log and "mapping 1 uid(s)" in log, log
        assert 'kvtierd_refused_total{reason="unmapped_peer"} 3.0' in d.metrics_text()
    finally:
        d.stop_and_verify()


# -- per-uid caps ----------------------------------------------------------------------------------
def test_one_user_cannot_take_every_session_or_connection_from_another(users, reachable_dir):
    other = users()
    # global caps 16 sessions / 48 connections: a quarter of each per uid
    d = _start(reachable_dir, "caps", env={"KVTIERD_MAX_SESSIONS": "16",
                                           "KVTIERD_MAX_CONNECTIONS": "48"})
    mine: list[RawClient] = []
    idle: list = []
    metrics_url = d.stats()["daemon"]["metrics"]
    try:
        for i in range(5):
            raw = RawClient(d.address)
            mine.append(raw)
            reply, _ = raw.request(Op.HELLO, namespace="n", rank=0, world_size=1,
                                   fingerprint="fp", staging=inline_staging(d.address))
            assert reply["name"] == ("OK" if i < 4 else "BUSY"), (i, reply)
        assert "max_sessions_per_uid is 4" in reply["message"], reply
        import zmq
        ctx = zmq.Context.instance()
        for _ in range(80):  # idle connections of this uid: before, they hid the socket
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(d.address)
            idle.append(sock)
        # this uid's own connections past its share are refused too (root's STATS included), so
        # watch from /metrics
        wait_for(lambda: sample(metrics_url, "kvtierd_refused_total",
                                reason="connections_per_uid") >= 40, timeout_s=20,
                 what="the guard refusing this uid's connections past its share")
        assert Path(d.address[len("ipc://"):]).exists(), "the socket was hidden"
        assert sample(metrics_url, "kvtierd_connections") <= 12 + 8  # its share, and a few
        # (refused, not yet closed by libzmq)
        started = time.monotonic()
        (hello, put, ping), = run_as(d.address, d.workdir, KEYS,
                                     (other, [{"op": "hello"}, {"op": "put", "seed": "o"},
                                              {"op": "ping"}]))
        assert hello[0] == "OK" and put == ["OK"] * len(KEYS) and ping == "OK", (hello, put, ping)
        assert time.monotonic() - started < 30
        assert sample(metrics_url, "kvtierd_refused_total", reason="sessions_per_uid") == 1
    finally:
        for sock in idle:
            sock.close(linger=0)
        for raw in mine:
            raw.close()
        # this uid's connections are gone once the daemon has seen them close (only then do its
        # own STATS/CHECK connections fit in its share again)
        wait_for(lambda: sample(metrics_url, "kvtierd_connections") == 0, timeout_s=20,
                 what="the crowd's connections closing")
        d.stop_and_verify()
