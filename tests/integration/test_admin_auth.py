"""With a token configured, only PING answers an unauthenticated peer: STATS and CHECK (O(chunks)
on the loop thread, and they tell who uses the daemon) need auth_token, admin_token or a session
opened with auth_token; admin_token opens no session."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers.bad_input import Session, namespace, write_toml
from helpers.metrics import sample
from helpers.raw import RawClient

from kvtierd.protocol import Op

pytestmark = pytest.mark.timeout(60)

INLINE_HELLO = dict(rank=0, world_size=1, fingerprint="fp-admin", staging={"kind": "inline"})


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVTIERD_")}
    return subprocess.run([sys.executable, "-m", "kvtierd", *args], capture_output=True,
                          text=True, timeout=30, env={**clean, **env})


def test_stats_and_check_refused_without_token(daemon_factory, tmp_path):
    config = write_toml(tmp_path / "tokens.toml",
                        'auth_token = "engine-secret"\nadmin_token = "monitor-secret"\n')
    d = daemon_factory("--config", str(config))
    raw = RawClient(d.address)
    try:
        for op in (Op.STATS, Op.CHECK):
            for token in (None, "", "wrong", "monitor-secret ", b"monitor-secret", 7):
                fields = {} if token is None else {"token": token}
                reply, _ = raw.request(op, **fields)
                assert reply["name"] == "AUTH_FAILED", (op, token, reply)
                assert "needs a token" in reply["message"], reply
                assert "secret" not in reply["message"]
            for token in ("monitor-secret", "engine-secret"):
                assert raw.request(op, token=token)[0]["name"] == "OK", (op, token)
        assert raw.request(Op.PING)[0]["name"] == "OK"
        # admin_token grants STATS/CHECK only: it opens no session
        reply, _ = raw.request(Op.HELLO, namespace=namespace(), token="monitor-secret",
                               **INLINE_HELLO)
        assert reply["name"] == "AUTH_FAILED", reply
        assert raw.request(Op.LOOKUP, keys=[b"k"])[0]["name"] == "NO_SESSION"
        # a session opened with auth_token may ask without repeating it
        s = Session(d.address, namespace(), token="engine-secret")
        try:
            assert s.request(Op.STATS)[0]["name"] == "OK"
            assert s.request(Op.CHECK)[0]["name"] == "OK"
        finally:
            s.close()
        refused = sample(d.stats()["daemon"]["metrics"], "kvtierd_refused_total", reason="auth")
        assert refused == 12, refused
        # the CLI reads the token from the environment (or the config file)
        result = _cli("stats", "--socket", d.address, "--json", env={})
        assert result.returncode == 1 and "AUTH_FAILED" in result.stderr, result
        result = _cli("stats", "--socket", d.address, "--json",
                      env={"KVTIERD_ADMIN_TOKEN": "monitor-secret"})
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["sessions"] == 0
        result = _cli("stats", "--config", str(config), "--socket", d.address, env={})
        assert result.returncode == 0, result.stderr
        assert _cli("ping", "--socket", d.address, env={}).returncode == 0
    finally:
        raw.close()


def test_admin_token_alone_guards_stats_but_not_hello(daemon_factory, tmp_path):
    config = write_toml(tmp_path / "admin.toml", 'admin_token = "monitor-secret"\n')
    d = daemon_factory("--config", str(config))
    s = Session(d.address, namespace())  # no auth_token: HELLO is open
    try:
        # a session that presented no token is no admin
        assert s.request(Op.STATS)[0]["name"] == "AUTH_FAILED"
        assert s.request(Op.CHECK)[0]["name"] == "AUTH_FAILED"
        assert s.request(Op.STATS, token="monitor-secret")[0]["name"] == "OK"
        assert s.lookup([b"k"]) == [0]
    finally:
        s.close()
