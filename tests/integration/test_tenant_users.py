"""Tenants by real users: two throwaway users A and B (``useradd``, removed at the end) run the same
model against one daemon. By default each is its own tenant (``uid:N``, from SO_PEERCRED on the
staging handshake): B reads 0 bytes of A's, probes 0 hits, overwrites and deletes nothing of A's.
Once one ``[tenants]`` entry names both uids, they share.
"""

from __future__ import annotations

import os
import pwd
import shutil
from pathlib import Path

import pytest
from helpers import as_users
from helpers.daemon import DaemonProcess

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.slow,  # a daemon and one child per test that imports the client (torch): ~15 s
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("useradd") is None,
                       reason="needs root and useradd (CI runs as root)"),
]

KEYS = [f"prefix-{i}" for i in range(4)]


def start(root: Path, name: str, config: str = "") -> DaemonProcess:
    flags = []
    if config:
        path = root / f"{name}.toml"
        path.write_text(config)
        flags = ["--config", str(path)]
    d = DaemonProcess(root / name, flags, env={"KVTIERD_SOCKET_MODE": "0666",
                                               "KVTIERD_EXPOSE_TENANT_STATS": "1"}, nvme_bytes="0")
    d.workdir.chmod(0o700)  # the daemon adds the search bits socket_mode needs
    d.start()
    return d


def run_as(d: DaemonProcess, *phases: tuple[pwd.struct_passwd, list[dict]]) -> list[list]:
    """Run each ``(user, steps)`` phase in turn as that user, in a session of its own; their
    results, in order."""
    outs = as_users.run_as(d.address, d.workdir, KEYS,
                           *((user, [{"op": "hello"}, *steps]) for user, steps in phases))
    for out in outs:
        assert out[0][0] == "OK", out[0]
    return [out[1:] for out in outs]


def test_user_b_cannot_read_probe_overwrite_or_delete_user_a_chunks(users, reachable_dir):
    a, b = users(), users()
    d = start(reachable_dir, "apart")
    try:
        stored, (lookup, get, put, delete, get_own), (again,) = run_as(
            d,
            (a, [{"op": "put", "seed": "a"}]),
            (b, [{"op": "lookup"}, {"op": "get", "seed": "a"}, {"op": "put", "seed": "b"},
                 {"op": "delete"}, {"op": "get", "seed": "b"}]),
            (a, [{"op": "get", "seed": "a"}]))
        assert stored == [["OK"] * 4]
        assert lookup == [0] * 4, "B probed A's prompts"
        assert get["results"] == ["MISS"] * 4 and get["untouched"] == [True] * 4, get
        assert put == ["OK"] * 4  # B's own chunks under the same keys, not EXISTS
        assert delete == ["OK"] * 4  # B's own, not A's
        assert get_own["results"] == ["MISS"] * 4
        assert again["results"] == ["OK"] * 4 and again["exact"] == [True] * 4, again
        tenants = d.stats()["tenants"]
        assert tenants[f"uid:{a.pw_uid}"]["used_bytes"] == 4 * 64 * 1024, tenants
        assert f"uid:{b.pw_uid}" not in tenants, tenants  # B holds nothing any more
        log = d.log()
        assert f"tenant uid:{a.pw_uid} (uid {a.pw_uid})" in log
        assert f"tenant uid:{b.pw_uid} (uid {b.pw_uid})" in log
    finally:
        d.stop_and_verify()


def test_users_named_in_one_tenant_share(users, reachable_dir):
    a, b = users(), users()
    d = start(reachable_dir, "shared", f"[tenants.team]\nuids = [{a.pw_uid}, {b.pw_uid}]\n")
    try:
        stored, (lookup, get, put) = run_as(
            d,
            (a, [{"op": "put", "seed": "a"}]),
            (b, [{"op": "lookup"}, {"op": "get", "seed": "a"}, {"op": "put", "seed": "a"}]))
        assert stored == [["OK"] * 4]
        assert lookup == [1] * 4, "B does not see its team's chunks"
        assert get["results"] == ["OK"] * 4 and get["exact"] == [True] * 4, get
        assert put == ["EXISTS"] * 4
        tenants = d.stats()["tenants"]
        assert tenants["team"]["used_bytes"] == 4 * 64 * 1024, tenants
        assert f"tenant team (uid {b.pw_uid})" in d.log()
    finally:
        d.stop_and_verify()
