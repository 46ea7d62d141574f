"""Sessions end cleanly whatever the client does: kill -9, BYE mid-PUT, silence, another layout,
a daemon restart."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import msgpack
import pytest
import torch
from helpers.wait import wait_for
from helpers.daemon import DaemonProcess
from helpers.kv import (
    assert_chunk_equals,
    assert_untouched_outside,
    chunk_pages,
    poison,
    random_kv,
    random_tokens,
    simple_layout,
)
from helpers.handshake import MemfdBuffer, ticket
from helpers.raw import RawClient

from kvtier_client import KVTierClient
from kvtierd.protocol import PROTOCOL_VERSION, Op, Status, Tier

pytestmark = pytest.mark.timeout(90)

TESTS_DIR = Path(__file__).resolve().parent.parent
SHM = Path("/dev/shm")


def staging_files(pid: int) -> list[str]:
    """Staging has no name in protocol 2: nothing of a client may appear in /dev/shm (the
    daemons' arenas are ``kvtierd-*``; protocol 1's staging files were ``kvtier-stg-<pid>-*``)."""
    return sorted(p.name for p in SHM.glob("kvtier-*") if str(pid) in p.name)


def daemon_maps_staging_of(daemon: DaemonProcess, pid: int) -> list[str]:
    """The daemon's mappings of the memfd staging of client ``pid`` (kvtier_client labels its
    memfds ``kvtier-staging-<pid>``)."""
    maps = Path(f"/proc/{daemon.proc.pid}/maps").read_text()
    return [line for line in maps.splitlines() if f"memfd:kvtier-staging-{pid} " in line]


def run_script(tmp_path: Path, name: str, body: str, *args: str, wait: bool = True):
    script = tmp_path / name
    prelude = f"import sys\nsys.path.insert(0, {str(TESTS_DIR)!r})\n"
    script.write_text(prelude + textwrap.dedent(body))
    log = open(tmp_path / f"{name}.log", "wb")
    proc = subprocess.Popen([sys.executable, str(script), *args], stdout=log,
                            stderr=subprocess.STDOUT)
    log.close()
    if wait:
        code = proc.wait(timeout=60)
        assert code == 0, (tmp_path / f"{name}.log").read_text()
    return proc


# -- (a) kill -9 of a client in the middle of its PUTs ---------------------------------------------

WRITER = """
import torch
from kvtier_client import KVGroup, KVLayout, KVTierClient

address = sys.argv[1]
page = 1024 * 1024 + 4093  # odd: chunks end inside an arena page
layout = KVLayout(groups=[KVGroup(tokens_per_block=16, page_bytes=page, layer_names=("a", "b"))],
                  blocks_per_chunk=2, tokens_per_hash=16, model="kill-me", dtype="bfloat16")
gen = torch.Generator().manual_seed(int(sys.argv[2]))
kv = {n: torch.randint(0, 256, (24, page), dtype=torch.uint8, generator=gen) for n in ("a", "b")}
with KVTierClient.connect(address, layout=layout, kv_caches=kv) as client:
    i = 0
    while True:  # ~4 MiB chunks, 12 per PUT, new keys every time: until SIGKILL
        tokens = torch.randint(0, 10**6, (12 * 32,), generator=gen).tolist()
        assert all(client.store(layout.plan(tokens, [list(range(24))])).result())
        i += 1
"""


def test_kill9_of_a_client_mid_put_leaks_nothing(daemon, tmp_path):
    rng = random.Random(1234)
    saw_pending = 0
    for attempt, mode in enumerate(["at-pending", "random", "random"]):
        proc = run_script(tmp_path, f"writer{attempt}.py", WRITER, daemon.address, str(attempt),
                          wait=False)
        try:
            wait_for(lambda: proc.poll() is not None or daemon.cpu().get("commits", 0) > 0,
                     30, "first commit of the writer")
            assert proc.poll() is None, (tmp_path / f"writer{attempt}.py.log").read_text()
            if mode == "at-pending":  # kill as soon as a PUT of the writer is seen in flight
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline:
                    if daemon.cpu()["pending_chunks"]:
                        saw_pending += 1
                        break
            else:
                time.sleep(rng.uniform(0.0, 0.25))
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

        def settled():
            s = daemon.stats()
            cpu = s["tiers"]["cpu"]
            return (s["sessions"] == 0 and cpu["pending_chunks"] == 0
                    and cpu["used_bytes"] == cpu["committed_bytes"]
                    and cpu["doomed_chunks"] == 0 and s)

        wait_for(settled, 10, f"cleanup after kill -9 #{attempt} ({mode})")
        daemon.check()
        assert staging_files(proc.pid) == [], "a killed client's staging file is left in /dev/shm"
        wait_for(lambda: not daemon_maps_staging_of(daemon, proc.pid), 5,
                 "the daemon unmapping the killed client's staging buffer")
    assert saw_pending > 0, "never saw a PUT of the writer in flight before killing it"
    assert daemon.alive()


def filled_memfd(nbytes: int) -> MemfdBuffer:
    """A raw memfd staging buffer holding random bytes, as the client library makes one."""
    buf = MemfdBuffer(nbytes)
    buf.write(0, os.urandom(nbytes))
    return buf


def put_then_bye(raw: RawClient, items: list, deadline_s: float = 30.0) -> dict[int, dict]:
    """Send a PUT and, without waiting, a BYE; return both replies by id (PUT 1001, BYE 1002).

    Whether the PUT's copies are still running when BYE ends the session is up to the scheduler:
    usually they are (the items are aborted, NO_SESSION), on a loaded machine they may have ended
    first (committed, OK). Callers check that each item is consistently one or the other.
    """
    raw.send_frames([msgpack.packb({"v": PROTOCOL_VERSION, "op": int(Op.PUT), "id": 1001,
                                    "secret": raw.secret, "items": items})])
    raw.send_frames([msgpack.packb({"v": PROTOCOL_VERSION, "op": int(Op.BYE), "id": 1002,
                                    "secret": raw.secret})])
    replies: dict[int, dict] = {}
    deadline = time.monotonic() + deadline_s
    while len(replies) < 2 and time.monotonic() < deadline:
        if raw.sock.poll(100):
            header = msgpack.unpackb(raw.sock.recv_multipart()[0])
            if header["id"]:
                replies[header["id"]] = header
    assert replies.get(1002, {}).get("status") == Status.OK, replies
    assert 1001 in replies, "the PUT sent before BYE was never answered"
    results = replies[1001]["results"]
    assert set(results) <= {Status.OK, Status.NO_SESSION}, replies[1001]
    return replies


def test_put_abandoned_by_bye_is_aborted_and_never_visible(daemon):
    chunk, count = 4 * 1024**2 + 123, 12  # ~48 MiB: copied on the daemon's copy threads
    buf = filled_memfd(chunk * count)
    raw, reader = RawClient(daemon.address), RawClient(daemon.address)
    try:
        rep, _ = raw.request(Op.HELLO, namespace="abandon", rank=0, world_size=1, fingerprint="fp",
                             staging=buf.hello_staging(daemon.address))
        assert rep["status"] == Status.OK, rep
        keys = [b"abandoned-%d" % i for i in range(count)]
        before = daemon.cpu()
        # PUT, then BYE at once: an item whose copy was still running when BYE ended the session
        # must be aborted (NO_SESSION, never visible), not committed
        results = put_then_bye(raw, [[k, i * chunk, chunk] for i, k in enumerate(keys)])[1001][
            "results"]
        aborted = [k for k, r in zip(keys, results) if r == Status.NO_SESSION]
        wait_for(lambda: daemon.cpu()["pending_chunks"] == 0, 10, "reservations settled")
        cpu = daemon.cpu()
        assert cpu["aborts"] - before.get("aborts", 0) == len(aborted), (cpu, results)
        assert cpu["chunks"] - before["chunks"] == count - len(aborted), (cpu, results)
        assert cpu["used_bytes"] == cpu["committed_bytes"]
        # An inline ticket: the reader is in the writer's tenant (uid), so a miss means something.
        rep, _ = reader.request(Op.HELLO, namespace="abandon", rank=0, world_size=1, fingerprint="fp",
                                staging={"kind": "inline", "ticket": ticket(daemon.address, "inline")})
        assert rep["status"] == Status.OK, rep
        assert lookup(reader, keys) == [0 if r == Status.NO_SESSION else int(Tier.CPU)
                                        for r in results], "an abandoned PUT became visible"
        assert daemon.stats()["sessions"] == 1
        daemon.check()
    finally:
        buf.close()
        raw.close()
        reader.close()


def test_put_pipelined_before_bye_still_gets_a_reply(daemon):
    chunk, count = 4 * 1024**2, 8
    buf = filled_memfd(chunk * count)
    raw = RawClient(daemon.address, timeout_s=3)
    try:
        rep, _ = raw.request(Op.HELLO, namespace="pipelined", rank=0, world_size=1, fingerprint="fp",
                             staging=buf.hello_staging(daemon.address))
        assert rep["status"] == Status.OK, rep
        results = put_then_bye(raw, [[b"k%d" % i, i * chunk, chunk] for i in range(count)])[
            1001]["results"]
    finally:
        buf.close()
        raw.close()
    wait_for(lambda: daemon.cpu()["pending_chunks"] == 0, 10, "reservations settled")
    reader = RawClient(daemon.address)
    try:
        # An inline ticket: the reader is in the writer's tenant (uid), so its lookups mean something.
        rep, _ = reader.request(Op.HELLO, namespace="pipelined", rank=0, world_size=1,
                                fingerprint="fp",
                                staging={"kind": "inline", "ticket": ticket(daemon.address, "inline")})
        assert rep["status"] == Status.OK, rep
        stored = [Status.OK if t else Status.NO_SESSION
                  for t in lookup(reader, [b"k%d" % i for i in range(count)])]
        assert stored == results, "the reply and the index disagree on what was stored"
    finally:
        reader.close()
    daemon.check()


# -- (b) a silent session is reaped and its leases released ----------------------------------------

def hello(raw: RawClient, namespace: str = "raw", fingerprint: str = "fp-raw") -> int:
    rep, _ = raw.request(Op.HELLO, namespace=namespace, rank=0, world_size=1, fingerprint=fingerprint,
                         staging={"kind": "inline", "ticket": ticket(raw.address, "inline")})
    assert rep["status"] == Status.OK, rep
    return rep["session"]


def put_inline(raw: RawClient, items: dict[bytes, bytes]) -> list[int]:
    rep, _ = raw.request(Op.PUT, frames=list(items.values()),
                         items=[[k, 0, len(v)] for k, v in items.items()])
    assert rep["status"] == Status.OK, rep
    return rep["results"]


def lookup(raw: RawClient, keys: list[bytes], lease: bool = False) -> list[int]:
    rep, _ = raw.request(Op.LOOKUP, keys=keys, lease=lease)
    assert rep["status"] == Status.OK, rep
    return rep["tiers"]


def fill(raw: RawClient, prefix: bytes, count: int, nbytes: int, keep_alive=None) -> None:
    for i in range(count):
        assert put_inline(raw, {prefix + b"%d" % i: os.urandom(nbytes)}) == [Status.OK]
        if keep_alive is not None:
            keep_alive()


def test_silent_session_is_reaped_and_its_leases_released(daemon_factory):
    d = daemon_factory("--session-timeout-s", "1", cpu_bytes="1MiB", page_bytes="64KiB",
                       nvme_bytes="0")
    page = 64 * 1024
    a, b, c = RawClient(d.address), RawClient(d.address), RawClient(d.address)
    try:
        hello(a)
        payload = os.urandom(page - 7)
        assert put_inline(a, {b"leased": payload}) == [Status.OK]
        assert lookup(a, [b"leased"], lease=True) == [1]
        hello(b)

        def ping_a():
            assert a.request(Op.PING)[0]["status"] == Status.OK

        # control: while A is alive its lease protects the oldest chunk from a 2x overfill
        fill(b, b"fill-b-", 32, page, keep_alive=ping_a)
        assert d.cpu()["evictions"] > 0
        assert lookup(b, [b"leased"]) == [1], "a leased chunk was evicted"
        assert d.stats()["sessions"] == 2

        # both go silent: reaped within a few seconds, not before the timeout
        silent_since = time.monotonic()
        wait_for(lambda: d.stats()["sessions"] == 0, 6, "silent sessions reaped")
        assert time.monotonic() - silent_since >= 0.8
        rep, _ = a.request(Op.LOOKUP, keys=[b"leased"], lease=False)
        assert rep["status"] == Status.NO_SESSION, rep
        rep, _ = a.request(Op.CHECK)  # pin counts agree: the dead session's lease is gone
        assert rep["status"] == Status.OK, rep
        d.check()

        # the chunk is still stored (reaping a session deletes nothing) ...
        hello(c)
        assert lookup(c, [b"leased"]) == [1]
        # ... but now evictable: the oldest chunk goes first under pressure
        fill(c, b"fill-c-", 32, page)
        assert lookup(c, [b"leased"]) == [0], "a reaped session's lease still pins its chunk"
        rep, _ = c.request(Op.GET, items=[[b"leased", 0, len(payload)]])
        assert rep["results"] == [Status.MISS]
        d.check()
    finally:
        for raw in (a, b, c):
            raw.close()


def test_lease_expires_while_its_session_lives(daemon_factory):
    d = daemon_factory("--lease-timeout-s", "0.5", cpu_bytes="1MiB", page_bytes="64KiB",
                       nvme_bytes="0")
    page = 64 * 1024
    a = RawClient(d.address)
    try:
        hello(a)
        assert put_inline(a, {b"leased": os.urandom(page)}) == [Status.OK]
        assert lookup(a, [b"leased"], lease=True) == [1]
        fill(a, b"f1-", 24, page)
        assert lookup(a, [b"leased"]) == [1], "evicted while leased"
        time.sleep(1.0)
        fill(a, b"f2-", 24, page)
        assert lookup(a, [b"leased"]) == [0], "the lease outlived lease_timeout_s"
        d.check()
    finally:
        a.close()


# -- (c) layouts never share chunks unless they are the same layout --------------------------------

BASE = dict(page_bytes=4096, layers=2, tokens_per_block=16, blocks_per_chunk=4, model="fp-model")
VARIANTS = {
    "page_bytes": dict(BASE, page_bytes=4100),
    "blocks_per_chunk": dict(BASE, blocks_per_chunk=2),  # keys collide with BASE at every 64 tokens
    "layer_count": dict(BASE, layers=3),
}


@pytest.mark.parametrize("shared_namespace", [False, True], ids=["own-ns", "same-ns"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_other_layout_never_sees_the_chunks(daemon, variant, shared_namespace):
    base, other = simple_layout(**BASE), simple_layout(**VARIANTS[variant])
    assert base.fingerprint != other.fingerprint
    gen = torch.Generator().manual_seed(21)
    tokens = random_tokens(gen, 4 * 64 + 9)
    table = [list(range(20))]
    kv1, kv2 = random_kv(base, [24], gen), random_kv(other, [24], gen)
    mine, theirs = base.plan(tokens, table), other.plan(tokens, table)
    mine_keys = {c.key for c in mine}
    colliding = [c.key in mine_keys for c in theirs]
    assert any(colliding), "identical tokens should give the variant some of the same keys"
    expected = [chunk_pages(base, kv1, c) for c in mine]
    ns = {"namespace": "one-namespace"} if shared_namespace else {}

    with KVTierClient.connect(daemon.address, layout=base, kv_caches=kv1, **ns) as c1, \
            KVTierClient.connect(daemon.address, layout=other, kv_caches=kv2, **ns) as c2:
        assert all(c1.store(mine).result(timeout=30))
        assert c2.lookup(theirs) == [False] * len(theirs)
        poison(kv2)
        assert c2.load(theirs).result(timeout=30) == [False] * len(theirs)
        assert_untouched_outside(other, kv2, [])
        # the other layout may store its own chunks, but never over the first layout's
        stored = c2.store(theirs).result(timeout=30)
        if shared_namespace:
            assert stored == [not hit for hit in colliding]
        else:
            assert stored == [True] * len(theirs)
        poison(kv1)
        assert c1.load(mine).result(timeout=30) == [True] * len(mine)
        for chunk, pages in zip(mine, expected):
            assert_chunk_equals(base, kv1, chunk, pages, f"after {variant} wrote")
    daemon.check()


SHARER = """
import json
import torch
from helpers.kv import random_kv, simple_layout
from kvtier_client import KVTierClient

address, spec, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
layout = simple_layout(page_bytes=4100, layers=2, blocks_per_chunk=4, model="shared")
gen = torch.Generator().manual_seed(99)
kv = random_kv(layout, [spec["blocks"]], gen)
with KVTierClient.connect(address, layout=layout, kv_caches=kv) as client:
    results = client.store(layout.plan(spec["tokens"], [spec["table"]])).result(timeout=30)
torch.save(kv, out)
print(json.dumps({"results": results, "fingerprint": layout.fingerprint}))
"""


def test_same_layout_in_another_process_shares_chunks(daemon, tmp_path):
    layout = simple_layout(page_bytes=4100, layers=2, blocks_per_chunk=4, model="shared")
    gen = torch.Generator().manual_seed(31)
    tokens = random_tokens(gen, 5 * 64 + 3)
    src_table, dst_table = list(range(21)), list(range(40, 19, -1))
    spec = {"tokens": tokens, "table": src_table, "blocks": 41}
    run_script(tmp_path, "sharer.py", SHARER, daemon.address, json.dumps(spec),
               str(tmp_path / "kv.pt"))
    out = json.loads((tmp_path / "sharer.py.log").read_text().strip().splitlines()[-1])
    assert out["fingerprint"] == layout.fingerprint and out["results"] == [True] * 5
    wait_for(lambda: daemon.stats()["sessions"] == 0, 5, "the writer's session ended")

    kv_src = torch.load(tmp_path / "kv.pt")
    src, dst = layout.plan(tokens, [src_table]), layout.plan(tokens, [dst_table])
    kv = random_kv(layout, [41], gen)
    with KVTierClient.connect(daemon.address, layout=layout, kv_caches=kv) as client:
        assert client.lookup(dst) == [True] * 5
        poison(kv)
        assert client.load(dst).result(timeout=30) == [True] * 5
    for s, t in zip(src, dst):
        assert_chunk_equals(layout, kv, t, chunk_pages(layout, kv_src, s), "shared")
    assert_untouched_outside(layout, kv, dst)
    daemon.check()


# -- (d) the client outlives a daemon restart ------------------------------------------------------

@pytest.mark.parametrize("how", ["sigterm-calls-while-down", "kill9-calls-while-down",
                                 "sigterm-idle"])
def test_client_keeps_working_across_a_daemon_restart(tmp_path, how):
    layout = simple_layout(page_bytes=4100, layers=2, blocks_per_chunk=4, model="restart")
    gen = torch.Generator().manual_seed(41)
    kv = random_kv(layout, [40], gen)
    first = layout.plan(random_tokens(gen, 2 * 64), [list(range(8))])
    second = layout.plan(random_tokens(gen, 3 * 64 + 1), [list(range(8, 21))])
    expected = {c.key: chunk_pages(layout, kv, c) for c in first + second}
    original = {name: t.clone() for name, t in kv.items()}
    workdir = tmp_path / "daemon"
    daemons = [DaemonProcess(workdir, [])]
    daemons[0].start()
    try:
        with KVTierClient.connect(daemons[0].address, layout=layout, kv_caches=kv,
                                  timeout_s=1.0) as client:
            assert all(client.store(first).result(timeout=30))
            if how.startswith("kill9"):
                daemons[0].kill9()
            else:
                daemons[0].stop_and_verify()
            assert not daemons[0].alive()
            if how.endswith("calls-while-down"):  # each call waits timeout_s, then misses
                started = time.monotonic()
                assert client.store(second).result(timeout=30) == [False] * len(second)
                poison(kv)
                assert client.load(first).result(timeout=30) == [False] * len(first)
                if how.startswith("sigterm"):
                    assert client.lookup(first) == [False] * len(first)
                assert time.monotonic() - started < 15
                assert_untouched_outside(layout, kv, [])
                for name, t in kv.items():
                    t.copy_(original[name])

            daemons.append(DaemonProcess(workdir, []))
            daemons[1].start()
            assert daemons[1].address == daemons[0].address
            assert client.store(second).result(timeout=30) == [True] * len(second)
            assert client.lookup(first) == [False] * len(first)  # a new daemon starts empty
            assert client.lookup(second) == [True] * len(second)
            poison(kv)
            assert client.load(second).result(timeout=30) == [True] * len(second)
            for chunk in second:
                assert_chunk_equals(layout, kv, chunk, expected[chunk.key], how)
            assert_untouched_outside(layout, kv, second)
            assert daemons[1].stats()["sessions"] == 1
            daemons[1].check()
        assert staging_files(os.getpid()) == []
    finally:
        for d in daemons:
            d.stop_and_verify()
