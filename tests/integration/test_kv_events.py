"""KV events, decoded with vLLM's own classes from a real daemon's PUB socket by a real SUB socket:
every store and every removal (DELETE, demotion, promotion, a failed NVMe check, another rank's
copy leaving) with the right medium, the PUT ``blocks`` field checked like every field, the
start's AllBlocksCleared fetched through the replay socket, and a publisher that cannot bind
failing the start before the arena.

CPU tier of 16 pages (64 KiB), chunks of one page: the 16th chunk crosses the high watermark and
the coldest chunks are demoted to NVMe (stored on STORAGE, then removed from CPU).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import zmq
from helpers.nvme import flip_byte, index_rows, metric, payload, sigterm, wait_settled
from helpers.handshake import ticket
from helpers.raw import RawClient
from helpers.wait import wait_for

from kvtierd.protocol import Op, Status, Tier

pytestmark = pytest.mark.timeout(180)

PAGE = 64 * 1024
NS = "org/model-ev/0123456789abcdef"  # model "org/model-ev": the topic carries it
MODEL = "org/model-ev"
NODE = "node-a"


@pytest.fixture(scope="module")
def kv_events():
    """vLLM's own event classes (vllm.distributed.kv_events): what routers decode."""
    return pytest.importorskip("vllm.distributed.kv_events")


def kv_utils():
    """vLLM's own hash naming (maybe_convert_block_hash), to compare ours with."""
    from vllm.v1.core import kv_cache_utils
    return kv_cache_utils


class Subscriber:
    """A SUB socket on the daemon's events, decoding every batch with vLLM's KVEventBatch."""

    def __init__(self, address: str, kv_events, daemon) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(address)
        self.decoder = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)
        self.events: list = []  # (topic, event)
        self.seqs: list[int] = []
        # The daemon counts subscriptions (XPUB): once it has ours, nothing published is missed.
        wait_for(lambda: metric(daemon.metrics_text(), "kvtierd_events_subscribers") >= 1, 30,
                 "the daemon saw the subscription")

    def drain(self) -> None:
        while self.sock.poll(0):
            topic, seq, data = self.sock.recv_multipart()
            batch = self.decoder.decode(data)
            assert batch.data_parallel_rank == 0
            self.seqs.append(int.from_bytes(seq, "big"))
            self.events.extend((topic, event) for event in batch.events)

    def wait(self, predicate, what: str):
        """The first event satisfying ``predicate``, waiting for it to arrive."""
        def found():
            self.drain()
            return next((e for t, e in self.events if predicate(e)), None)
        return wait_for(found, 90, what)  # generous: CI machines are loaded

    def of(self, kind: str, hashes: list, medium: str) -> list:
        self.drain()
        return [e for _, e in self.events if type(e).__name__ == kind
                and list(e.block_hashes) == hashes and e.medium == medium]

    def close(self) -> None:
        self.sock.close(linger=0)


def hello(address: str, rank: int = 0) -> RawClient:
    raw = RawClient(address, timeout_s=30)
    rep, _ = raw.request(Op.HELLO, namespace=NS, rank=rank, world_size=2, fingerprint="fp-ev",
                         staging={"kind": "inline", "ticket": ticket(address, "inline")})
    assert rep["status"] == Status.OK, rep
    return raw


def put(raw: RawClient, chunks: dict[bytes, bytes], blocks: list | None = None) -> dict:
    fields = {"items": [[k, 0, len(v)] for k, v in chunks.items()]}
    if blocks is not None:
        fields["blocks"] = blocks
    rep, _ = raw.request(Op.PUT, frames=list(chunks.values()), **fields)
    assert rep["status"] == Status.OK, rep
    return rep


def h(n: int) -> bytes:
    """An engine block hash (vLLM's are 32-byte sha256 digests)."""
    return n.to_bytes(4, "big") * 8


def w(*hashes: bytes) -> list[int]:
    """The hashes as published (events_int_hashes, the default): vLLM's uint64 naming."""
    return [int.from_bytes(x, "big") & (2**64 - 1) for x in hashes]


def replay(address: str, decoder) -> list[tuple[bytes, int, list]]:
    """Every buffered batch from sequence 0, as ``(topic, seq, events)``. vLLM's protocol:
    [b"", start] in, [b"", topic, seq, payload] per batch out, then [b"", b"", -1, b""]; a DEALER
    reads the whole stream (a REQ only its first message)."""
    req = zmq.Context.instance().socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(address)
    replayed = []
    try:
        req.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            assert req.poll(30_000), "no replay answer"
            empty, topic, seq, data = req.recv_multipart()
            assert empty == b""
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert data == b"" and topic == b""
                return replayed
            replayed.append((topic, int.from_bytes(seq, "big"), decoder.decode(data).events))
    finally:
        req.close(linger=0)


@pytest.fixture
def events_daemon(daemon_factory, tmp_path):
    sock_dir = Path(tmp_path) / "ev"
    sock_dir.mkdir()
    d = daemon_factory("--events-addr", f"ipc://{sock_dir / 'events.sock'}",
                       cpu_bytes="1MiB", nvme_bytes="8MiB",
                       env={"KVTIERD_EVENTS_REPLAY_ADDR": f"ipc://{sock_dir / 'replay.sock'}",
                            "KVTIERD_EVENTS_NODE": NODE})
    d.events_addr = f"ipc://{sock_dir / 'events.sock'}"
    d.replay_addr = f"ipc://{sock_dir / 'replay.sock'}"
    return d


def test_every_store_and_removal_is_published_in_vllms_format(events_daemon, kv_events):
    d = events_daemon
    sub = Subscriber(d.events_addr, kv_events, d)
    raw, raw1 = hello(d.address), hello(d.address, rank=1)
    try:
        data = {k: payload(k, PAGE) for k in (b"a", b"b", b"c", b"d")}
        tokens = list(range(1000, 1032))
        rep = put(raw, data, blocks=[
            {"hashes": [h(1), h(2)], "parent": h(0), "tokens": tokens, "block_size": 16,
             "group": 0},
            {"hashes": [h(3)], "group": 1},  # hashes only: a "these known blocks" update
            None,  # no blocks: the chunk key stands in
            {"hashes": [h(4)], "tokens": [1, 2, 3], "block_size": 16},  # 3 != 16 x 1: refused
        ])
        assert rep["results"][:3] == [Status.OK] * 3 and rep["results"][3] == Status.BAD_REQUEST
        assert "blocks[3]" in rep["errors"][0][2] and "block_size" in rep["errors"][0][2]

        a = sub.wait(lambda e: isinstance(e, kv_events.BlockStored)
                     and e.block_hashes == w(h(1), h(2)),
                     "BlockStored of chunk a")
        assert (a.parent_block_hash, a.token_ids, a.block_size, a.group_idx, a.medium,
                a.locality) == (w(h(0))[0], tokens, 16, 0, "CPU", "LOCAL")
        assert a.block_hashes == [kv_utils().maybe_convert_block_hash(x) for x in (h(1), h(2))]
        b = sub.wait(lambda e: getattr(e, "block_hashes", None) == w(h(3)), "BlockStored of b")
        assert (b.token_ids, b.block_size, b.group_idx, b.medium) == ([], 0, 1, "CPU")
        c = sub.wait(lambda e: getattr(e, "block_hashes", None) == w(b"c"), "BlockStored of c")
        assert isinstance(c, kv_events.BlockStored) and c.medium == "CPU"
        assert not sub.of("BlockStored", w(h(4)), "CPU"), "a refused item was announced"
        topics = {t for t, _ in sub.events}
        assert topics == {f"kv@{NODE}@{MODEL}".encode()}, topics

        # Another rank's copy: not announced again; its removal ends the prefix on this node.
        put(raw1, {b"a": payload(b"a1", PAGE)})
        rep, _ = raw1.request(Op.DELETE, keys=[b"a"])
        assert rep["results"] == [Status.OK]
        sub.wait(lambda e: isinstance(e, kv_events.BlockRemoved)
                 and e.block_hashes == w(h(1), h(2)),
                 "BlockRemoved of a (rank 1's copy deleted)")
        rep, _ = raw.request(Op.DELETE, keys=[b"a"])
        assert rep["results"] == [Status.OK]

        # Pressure: 16 more one-page chunks demote the coldest (b, c first) to NVMe.
        fill = {f"f{i:02d}".encode(): payload(i, PAGE) for i in range(16)}
        put(raw, fill, blocks=[{"hashes": [h(100 + i)]} for i in range(16)])
        wait_settled(d)
        assert sub.wait(lambda e: getattr(e, "block_hashes", None) == w(h(3))
                        and isinstance(e, kv_events.BlockStored) and e.medium == "STORAGE",
                        "b stored on STORAGE").group_idx == 1  # what the PUT said, kept
        sub.wait(lambda e: isinstance(e, kv_events.BlockRemoved) and e.block_hashes == w(h(3))
                 and e.medium == "CPU", "b removed from CPU after its demotion")
        rep, _ = raw.request(Op.LOOKUP, keys=[b"b", b"c"])
        assert rep["tiers"] == [Tier.NVME, Tier.NVME], rep

        # A GET promotes b back: stored on CPU again, with its hashes.
        before = len(sub.of("BlockStored", w(h(3)), "CPU"))
        rep, frames = raw.request(Op.GET, items=[[b"b", 0, PAGE]])
        assert rep["results"] == [Status.OK] and frames[0] == data[b"b"]
        wait_for(lambda: len(sub.of("BlockStored", w(h(3)), "CPU")) > before, 90,
                 "b stored on CPU again after its promotion")

        # A flipped byte on NVMe: the read fails its check, the chunk is dropped from STORAGE.
        rows = index_rows(d.workdir / "nvme")
        flip_byte(d.workdir / "nvme" / "chunks.data", PAGE, rows[(NS, 0, b"c")]["runs"])
        rep, _ = raw.request(Op.GET, items=[[b"c", 0, PAGE]])
        assert rep["results"] == [Status.CHECKSUM_MISMATCH], rep
        sub.wait(lambda e: isinstance(e, kv_events.BlockRemoved) and e.block_hashes == w(b"c")
                 and e.medium == "STORAGE", "c removed from STORAGE after its failed check")

        # DELETE of a chunk on both tiers: removed from both.
        rep, _ = raw.request(Op.DELETE, keys=[b"b"])
        assert rep["results"] == [Status.OK]
        for medium in ("CPU", "STORAGE"):
            wait_for(lambda m=medium: sub.of("BlockRemoved", w(h(3)), m), 90,
                     f"b removed from {medium} by DELETE")
        wait_settled(d)
        sub.drain()
        assert sub.seqs == sorted(sub.seqs) and len(set(sub.seqs)) == len(sub.seqs), sub.seqs
        text = d.metrics_text()
        assert metric(text, "kvtierd_events_enabled") == 1
        assert metric(text, "kvtierd_events_total", kind="stored") >= 20
        assert metric(text, "kvtierd_events_dropped_total") == 0
    finally:
        raw.close()
        raw1.close()
        sub.close()


def test_replay_returns_the_start_clear_and_every_batch_since(events_daemon, kv_events):
    d = events_daemon
    sub = Subscriber(d.events_addr, kv_events, d)
    raw = hello(d.address)
    try:
        put(raw, {b"r1": payload(b"r1", PAGE)}, blocks=[{"hashes": [h(7)]}])
        sub.wait(lambda e: getattr(e, "block_hashes", None) == w(h(7)), "BlockStored of r1")
        # The field itself is checked too: one entry per item, or nil.
        for bad in ([None, None], {"hashes": [h(8)]}):
            rep, _ = raw.request(Op.PUT, frames=[payload(b"r2", PAGE)],
                                 items=[[b"r2", 0, PAGE]], blocks=bad)
            assert rep["name"] == "BAD_REQUEST" and "'blocks'" in rep["message"], rep
        replayed = replay(d.replay_addr, sub.decoder)
    finally:
        raw.close()
        sub.close()
    assert replayed[0][1] == 0 and replayed[0][0] == f"kv@{NODE}@".encode()
    assert "AllBlocksCleared" not in [type(e).__name__ for _, _, es in replayed[1:] for e in es]
    assert [type(e).__name__ for e in replayed[0][2]] == ["AllBlocksCleared"]
    assert [s for _, s, _ in replayed] == list(range(len(replayed)))
    assert any(getattr(e, "block_hashes", None) == w(h(7)) for _, _, es in replayed for e in es)


def test_a_clean_stop_says_all_blocks_cleared_last(events_daemon, kv_events):
    d = events_daemon
    sub = Subscriber(d.events_addr, kv_events, d)
    raw = hello(d.address)
    try:
        put(raw, {b"s1": payload(b"s1", PAGE)})
        sub.wait(lambda e: getattr(e, "block_hashes", None) == w(b"s1"), "BlockStored of s1")
    finally:
        raw.close()
    d.check()
    d.proc.send_signal(signal.SIGTERM)
    assert d.proc.wait(timeout=30) == 0, d.log()
    try:
        sub.wait(lambda e: isinstance(e, kv_events.AllBlocksCleared), "AllBlocksCleared at stop")
        assert isinstance(sub.events[-1][1], kv_events.AllBlocksCleared)
    finally:
        sub.close()
    assert "Traceback" not in d.log()


def test_a_clean_restart_re_announces_what_it_recovered_and_a_crash_does_not(events_daemon,
                                                                               kv_events):
    """The chunks an NVMe tier keeps across a clean restart are announced again (after the
    start's AllBlocksCleared, with the hashes their PUT gave); after a crash nothing is (the
    snapshot is a clean stop's, and a start deletes it)."""
    d = events_daemon
    sub = Subscriber(d.events_addr, kv_events, d)
    raw = hello(d.address)
    try:
        put(raw, {b"kept": payload(b"kept", PAGE)},
            blocks=[{"hashes": [h(201), h(202)], "parent": h(200), "group": 1}])
        put(raw, {b"gone": payload(b"gone", PAGE)}, blocks=[{"hashes": [h(203)]}])
        fill = {f"g{i:02d}".encode(): payload(300 + i, PAGE) for i in range(16)}
        put(raw, fill, blocks=[{"hashes": [h(300 + i)]} for i in range(16)])
        wait_settled(d)
        for hashes in (w(h(201), h(202)), w(h(203))):
            sub.wait(lambda e, x=hashes: isinstance(e, kv_events.BlockStored)
                     and e.block_hashes == x and e.medium == "STORAGE", f"{hashes} on STORAGE")
        rep, _ = raw.request(Op.DELETE, keys=[b"gone"])
        assert rep["results"] == [Status.OK]
        sub.wait(lambda e: isinstance(e, kv_events.BlockRemoved) and e.block_hashes == w(h(203))
                 and e.medium == "STORAGE", "gone removed from STORAGE")
    finally:
        raw.close()
        sub.close()
    sigterm(d)
    snapshot = d.workdir / "nvme" / "events.snapshot"
    assert snapshot.stat().st_mode & 0o777 == 0o600
    d.restart()
    assert not snapshot.exists(), "a start must take the snapshot (a crash must not reuse it)"
    decoder = msgspec.msgpack.Decoder(type=kv_events.KVEventBatch)
    events = [e for _, _, es in replay(d.replay_addr, decoder) for e in es]
    assert type(events[0]).__name__ == "AllBlocksCleared"
    stored = [e for e in events if isinstance(e, kv_events.BlockStored)]
    kept = [e for e in stored if e.block_hashes == w(h(201), h(202))]
    assert [(e.medium, e.parent_block_hash, e.group_idx, e.token_ids) for e in kept] == [
        ("STORAGE", w(h(200))[0], 1, [])], kept
    assert not [e for e in stored if e.block_hashes == w(h(203))], "a deleted chunk re-announced"
    assert all(e.medium == "STORAGE" for e in stored)  # the arena is not persistent: CPU is empty
    put_hashes = [w(h(201), h(202))] + [w(h(300 + i)) for i in range(16)]
    assert all(e.block_hashes in put_hashes for e in stored), stored
    raw = hello(d.address)
    try:
        rep, frames = raw.request(Op.GET, items=[[b"kept", 0, PAGE]])
        assert rep["results"] == [Status.OK] and frames[0] == payload(b"kept", PAGE)
    finally:
        raw.close()
    d.kill9()
    d.restart()
    events = [e for _, _, es in replay(d.replay_addr, decoder) for e in es]
    assert not [e for e in events if isinstance(e, kv_events.BlockStored)
                and e.medium == "STORAGE"], "re-announced after a crash"


def test_events_are_off_by_default(daemon):
    text = daemon.metrics_text()
    assert metric(text, "kvtierd_events_enabled") == 0
    assert "kvtierd_events_dropped_total" in text


def test_an_events_address_that_cannot_be_bound_fails_the_start_before_the_arena(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    arena = f"kvtierd-evtest-{os.getpid()}"
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "kvtierd", "serve", "--socket", f"ipc://{tmp_path / 'k.sock'}",
             "--metrics-addr", "off", "--nvme-bytes", "0", "--arena-name", arena,
             "--events-addr", f"tcp://127.0.0.1:{port}"],
            capture_output=True, text=True, timeout=60)
    finally:
        taken.close()
    assert proc.returncode != 0
    assert "events_addr" in proc.stderr and str(port) in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not Path(f"/dev/shm/{arena}").exists()


def test_the_client_library_announces_its_prefix_hashes(events_daemon, kv_events):
    """KVTierClient learns from HELLO that the daemon publishes events and sends each chunk's
    prefix hashes (one per tokens_per_hash) and parent: the chain a router follows."""
    import torch
    from helpers.kv import blocks_needed, random_kv, random_tokens, simple_layout

    from kvtier_client import KVTierClient
    from kvtier_client.hashing import prefix_hashes

    d = events_daemon
    sub = Subscriber(d.events_addr, kv_events, d)
    gen = torch.Generator().manual_seed(13)
    layout = simple_layout(page_bytes=4096, model="events-client")
    tokens = random_tokens(gen, 3 * 64 + 7)  # three chunks of 4 blocks x 16 tokens
    chunks = layout.plan(tokens, [list(range(blocks_needed(layout, len(tokens))[0]))])
    kv = random_kv(layout, blocks_needed(layout, len(tokens)), gen)
    try:
        with KVTierClient.connect(d.address, layout=layout, kv_caches=kv) as client:
            assert client.store(chunks).result(timeout=30) == [True] * 3
        chain = prefix_hashes(tokens, 16)
        for c in range(3):
            event = sub.wait(lambda e, c=c: isinstance(e, kv_events.BlockStored)
                             and e.block_hashes == w(*chain[4 * c:4 * c + 4]),
                             f"chunk {c} announced")
            assert event.parent_block_hash == (w(chain[4 * c - 1])[0] if c else None)
            assert (event.medium, event.group_idx, event.token_ids) == ("CPU", 0, [])
        assert {t for t, _ in sub.events} == {f"kv@{NODE}@events-client".encode()}
    finally:
        sub.close()
