"""Run a raw client's steps as other (throwaway) users against a real daemon.

``run_as(address, phases)`` starts one Python process (as root: the venv may be root-only, and
importing takes seconds on a busy CI host) that forks a child per phase; the child drops to the
phase's uid/gid for good and runs its steps as one raw memfd-staging session, then reports its
results as JSON. Steps:

* ``{"op": "hello", "token"?: str}``: handshake (a memfd) and HELLO; the reply's name and message;
* ``{"op": "put" | "get", "seed": str}``: the plan's keys, random payloads from ``seed``
  (``get`` reports per key whether the bytes are the seed's and whether the poison is untouched);
* ``{"op": "lookup"}``: the tiers of the plan's keys; ``{"op": "delete"}``: their statuses;
* ``{"op": "ping"}``: a fresh connection's PING (its reply name, or "TIMEOUT" after 2 s).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

TESTS_DIR = Path(__file__).resolve().parent.parent
CHUNK = 20000

_SCRIPT = """
import json, os, random, sys
from helpers.handshake import MemfdBuffer
from helpers.raw import RawClient
from kvtierd.protocol import Op, Status

address, plan = sys.argv[1], json.loads(sys.argv[2])
CHUNK, POISON = %(chunk)d, 0xEE
keys = [k.encode() for k in plan["keys"]]
items = [[k, i * CHUNK, CHUNK] for i, k in enumerate(keys)]


def payload(seed, key):
    return random.Random(f"{seed}/{key}").randbytes(CHUNK)


def ping():
    raw = RawClient(address, timeout_s=2.0)
    try:
        return raw.request(Op.PING)[0]["name"]
    except AssertionError:
        return "TIMEOUT"
    finally:
        raw.close()


def run(steps):
    buf = MemfdBuffer(len(keys) * CHUNK)
    raw = RawClient(address)
    out = []
    for step in steps:
        op, seed = step["op"], step.get("seed")
        if op == "hello":
            extra = {"token": step["token"]} if "token" in step else {}
            reply, _ = raw.request(Op.HELLO, namespace="same-model", rank=0, world_size=1,
                                   fingerprint="same-layout",
                                   staging=buf.hello_staging(address), **extra)
            out.append([reply["name"], reply["message"]])
        elif op == "put":
            for i, k in enumerate(keys):
                buf.write(i * CHUNK, payload(seed, k))
            reply, _ = raw.request(Op.PUT, items=items)
            out.append([Status(r).name for r in reply["results"]] if "results" in reply
                       else reply["name"])
        elif op == "get":
            buf.fill(POISON)
            reply, _ = raw.request(Op.GET, items=items)
            got = [buf.read(i * CHUNK, CHUNK) for i in range(len(keys))]
            out.append({"results": [Status(r).name for r in reply.get("results", [])],
                        "name": reply["name"],
                        "exact": [g == payload(seed, k) for g, k in zip(got, keys)],
                        "untouched": [g == bytes([POISON]) * CHUNK for g in got]})
        elif op == "lookup":
            reply, _ = raw.request(Op.LOOKUP, keys=keys)
            out.append(reply.get("tiers", reply["name"]))
        elif op == "delete":
            reply, _ = raw.request(Op.DELETE, keys=keys)
            out.append([Status(r).name for r in reply["results"]] if "results" in reply
                       else reply["name"])
        elif op == "ping":
            out.append(ping())
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


def run_as(address: str, workdir: Path, keys: list[str],
           *phases: tuple[Any, list[dict]]) -> list[list]:
    """Run each ``(user, steps)`` phase in turn as that user (a ``pwd.struct_passwd``); their
    results, in order."""
    script = workdir / "as_users.py"
    script.write_text(f"import sys\nsys.path.insert(0, {str(TESTS_DIR)!r})\n"
                      + textwrap.dedent(_SCRIPT % {"chunk": CHUNK}))
    plan = {"keys": keys, "phases": [{"uid": u.pw_uid, "gid": u.pw_gid, "steps": steps}
                                     for u, steps in phases]}
    done = subprocess.run([sys.executable, str(script), address, json.dumps(plan)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert [r["uid"] for r in results] == [u.pw_uid for u, _ in phases]
    return [r["out"] for r in results]
