"""Tenants by real users: two throwaway users A and B (``useradd``, removed at the end) run the same
model against one daemon. By default each is its own tenant (``uid:N``, from SO_PEERCRED on the
staging handshake): B reads 0 bytes of A's, probes 0 hits, overwrites and deletes nothing of A's.
Once one ``[tenants]`` entry names both uids, they share.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.daemon import DaemonProcess

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.slow,  # a daemon and one child per test that imports the client (torch): ~15 s
    pytest.mark.skipif(os.geteuid() != 0 or shutil.which("useradd") is None,
                       reason="needs root and useradd (CI runs as root)"),
]

TESTS_DIR = Path(__file__).resolve().parent.parent
KEYS = [f"prefix-{i}" for i in range(4)]

# Imports once as root (the venv may be root-only; importing takes seconds on a busy CI host), then
# runs each phase in a forked child that drops to the phase's user for good and runs its ops as one
# raw memfd-staging session. Prints one JSON line: per phase, the uid it ran as and its results.
USER_SCRIPT = """
import json, os, random, sys
from helpers.handshake import MemfdBuffer
from helpers.raw import RawClient
from kvtierd.protocol import Op, Status

address, plan = sys.argv[1], json.loads(sys.argv[2])
CHUNK, POISON = 20000, 0xEE
keys = [k.encode() for k in plan["keys"]]
items = [[k, i * CHUNK, CHUNK] for i, k in enumerate(keys)]


def payload(seed, key):
    return random.Random(f"{seed}/{key}").randbytes(CHUNK)


def run(steps):
    buf = MemfdBuffer(len(keys) * CHUNK)
    raw = RawClient(address)
    reply, _ = raw.request(Op.HELLO, namespace="same-model", rank=0, world_size=1,
                           fingerprint="same-layout", staging=buf.hello_staging(address))
    assert reply["name"] == "OK", reply
    out = []
    for step in steps:
        op, seed = step["op"], step.get("seed")
        if op == "put":
            for i, k in enumerate(keys):
                buf.write(i * CHUNK, payload(seed, k))
            reply, _ = raw.request(Op.PUT, items=items)
            out.append([Status(r).name for r in reply["results"]])
        elif op == "get":
            buf.fill(POISON)
            reply, _ = raw.request(Op.GET, items=items)
            got = [buf.read(i * CHUNK, CHUNK) for i in range(len(keys))]
            out.append({"results": [Status(r).name for r in reply["results"]],
                        "exact": [g == payload(seed, k) for g, k in zip(got, keys)],
                        "untouched": [g == bytes([POISON]) * CHUNK for g in got]})
        elif op == "lookup":
            reply, _ = raw.request(Op.LOOKUP, keys=keys)
            out.append(reply["tiers"])
        elif op == "delete":
            reply, _ = raw.request(Op.DELETE, keys=keys)
            out.append([Status(r).name for r in reply["results"]])
    raw.request(Op.BYE)
    raw.close()
    buf.close()
    return out


phases = []
for phase in plan["phases"]:
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:
        code = 1
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(phase["gid"])
            os.setuid(phase["uid"])  # from here on this child is the user
            result = {"uid": os.getuid(), "out": run(phase["steps"])}
            os.write(write_end, json.dumps(result).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        data = f.read()
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"phase as uid {phase['uid']} failed"
    phases.append(json.loads(data))
print(json.dumps(phases))
"""


def start(root: Path, name: str, config: str = "") -> DaemonProcess:
    flags = []
    if config:
        path = root / f"{name}.toml"
        path.write_text(config)
        flags = ["--config", str(path)]
    d = DaemonProcess(root / name, flags, env={"KVTIERD_SOCKET_MODE": "0666"}, nvme_bytes="0")
    d.workdir.chmod(0o700)  # the daemon adds the search bits socket_mode needs
    d.start()
    return d


def run_as(d: DaemonProcess, *phases: tuple[pwd.struct_passwd, list[dict]]) -> list[list]:
    """Run each ``(user, steps)`` phase in turn as that user; their results, in order."""
    script = d.workdir / "as_users.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(TESTS_DIR)!r})\n"
                      + textwrap.dedent(USER_SCRIPT))
    plan = {"keys": KEYS, "phases": [{"uid": u.pw_uid, "gid": u.pw_gid, "steps": steps}
                                     for u, steps in phases]}
    done = subprocess.run([sys.executable, str(script), d.address, json.dumps(plan)],
                          capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert [r["uid"] for r in results] == [u.pw_uid for u, _ in phases]
    return [r["out"] for r in results]


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
