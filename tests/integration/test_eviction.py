"""A small CPU tier (no NVMe tier below it) under pressure: LRU eviction, leases, and chunks
that can never fit.

4 MiB tier of 64 KiB pages = 64 pages; a chunk here is 2 layers x 4 blocks x 16000 bytes = 128000
bytes = 2 pages. Every hit must be byte-exact and every miss must leave its blocks untouched.
"""

from __future__ import annotations

import ctypes
import os

import msgpack
import pytest
import torch
from helpers.kv import (
    POISON,
    assert_chunk_equals,
    assert_chunk_poisoned,
    assert_untouched_outside,
    chunk_pages,
    poison,
    random_kv,
    random_tokens,
    simple_layout,
)

from helpers.handshake import MemfdBuffer
from helpers.raw import RawClient

from kvtier_client import KVGroup, KVLayout, KVTierClient
from kvtierd.protocol import PROTOCOL_VERSION, Op, Status

pytestmark = pytest.mark.timeout(60)

PAGE = 16000
TOKENS_PER_CHUNK = 16 * 4
BLOCKS_PER_PROMPT = 100


def small_tier(daemon_factory):
    d = daemon_factory(cpu_bytes="4MiB", page_bytes="64KiB", nvme_bytes="0")
    assert d.cpu()["capacity_bytes"] == 64 * 64 * 1024
    return d


def prompts(layout, gen, sizes: list[int]):
    """One plan per prompt: ``sizes[p]`` chunks on its own block range."""
    out = []
    for p, n in enumerate(sizes):
        tokens = random_tokens(gen, n * TOKENS_PER_CHUNK + 5)
        blocks = list(range(p * BLOCKS_PER_PROMPT, (p + 1) * BLOCKS_PER_PROMPT))
        chunks = layout.plan(tokens, [blocks])
        assert len(chunks) == n
        out.append(chunks)
    return out


def test_overfull_tier_keeps_recent_chunks_and_never_serves_wrong_bytes(daemon_factory):
    d = small_tier(daemon_factory)
    layout = simple_layout(page_bytes=PAGE, layers=2, blocks_per_chunk=4)
    assert layout.chunk_nbytes(0) == 128000
    gen = torch.Generator().manual_seed(11)
    sizes = [20] * 6  # 6 x 40 pages into a 64-page tier
    kv = random_kv(layout, [BLOCKS_PER_PROMPT * len(sizes)], gen)
    plans = prompts(layout, gen, sizes)
    expected = [[chunk_pages(layout, kv, c) for c in chunks] for chunks in plans]
    capacity = d.cpu()["capacity_bytes"]

    with KVTierClient.connect(d.address, layout=layout, kv_caches=kv) as client:
        for chunks in plans:
            assert client.store(chunks).result(timeout=30) == [True] * len(chunks)
            cpu = d.cpu()
            assert cpu["used_bytes"] <= capacity and cpu["pending_chunks"] == 0
        cpu = d.cpu()
        assert cpu["evictions"] > 0
        # eviction runs down to the low watermark once the high one (95 %) is passed
        assert cpu["used_bytes"] <= 0.95 * capacity
        hits = [client.lookup(chunks) for chunks in plans]
        assert all(hits[-1]), "the most recent prompt was evicted"
        assert not any(hits[0]), "the oldest prompt survived 3x overcommit"
        assert sum(map(sum, hits)) == cpu["chunks"]
        # LRU at prompt granularity: once a prompt hits fully, every later one does too
        fully = [all(h) for h in hits]
        first_full = fully.index(True)
        assert all(fully[first_full:]), hits
        assert not any(map(any, hits[: max(0, first_full - 1)])), hits

        poison(kv)
        flat = [c for chunks in plans for c in chunks]
        loaded = client.load(flat).result(timeout=30)
    assert loaded == [h for row in hits for h in row], "load and lookup disagree"
    for chunks, pages, row in zip(plans, expected, hits):
        for chunk, page_list, hit in zip(chunks, pages, row):
            if hit:
                assert_chunk_equals(layout, kv, chunk, page_list, "evicting tier")
            else:
                assert_chunk_poisoned(layout, kv, chunk, "evicting tier")
    assert_untouched_outside(layout, kv, [c for c, ok in zip(flat, loaded) if ok])
    d.check()


def test_leased_chunks_survive_pressure_until_their_get(daemon_factory):
    d = small_tier(daemon_factory)
    layout = simple_layout(page_bytes=PAGE, layers=2, blocks_per_chunk=4)
    gen = torch.Generator().manual_seed(12)
    sizes = [8, 8, 12, 12, 12, 12, 12, 12]
    kv = random_kv(layout, [BLOCKS_PER_PROMPT * len(sizes)], gen)
    leased, unleased, *rest = prompts(layout, gen, sizes)
    before, after = rest[:3], rest[3:]
    expected = [chunk_pages(layout, kv, c) for c in leased]

    with KVTierClient.connect(d.address, layout=layout, kv_caches=kv) as client:
        assert all(client.store(leased).result(timeout=30))
        assert all(client.store(unleased).result(timeout=30))
        # the oldest prompt is leased; the newer one is not
        assert client.lookup(leased, lease=True) == [True] * len(leased)
        for chunks in before:  # 72 more pages into a 64-page tier
            assert all(client.store(chunks).result(timeout=30))
        assert d.cpu()["evictions"] > 0
        d.check()  # pin counts agree with the session's leases
        assert client.lookup(unleased) == [False] * len(unleased), \
            "an unleased chunk newer than the leased ones should have been evicted first"
        assert client.lookup(leased) == [True] * len(leased), "a leased chunk was evicted"

        poison(kv)
        assert client.load(leased).result(timeout=30) == [True] * len(leased)
        for chunk, pages in zip(leased, expected):
            assert_chunk_equals(layout, kv, chunk, pages, "leased")
        assert_untouched_outside(layout, kv, leased)

        # the GET consumed the leases: the (now oldest) chunks are evictable again
        for chunks in after:
            assert all(client.store(chunks).result(timeout=30))
        assert client.lookup(leased) == [False] * len(leased), "leases outlived their GET"
    d.check()


def test_chunk_larger_than_the_tier_is_refused_and_the_daemon_keeps_serving(daemon_factory):
    d = small_tier(daemon_factory)
    huge_page = 1024**2 + 1  # 4 blocks = 4 MiB + 4 bytes: one page more than the whole tier
    layout = KVLayout(
        groups=[KVGroup(tokens_per_block=16, page_bytes=PAGE, layer_names=("s0", "s1")),
                KVGroup(tokens_per_block=16, page_bytes=huge_page, layer_names=("h0",))],
        blocks_per_chunk=4, tokens_per_hash=16, model="huge", dtype="bfloat16")
    assert layout.chunk_nbytes(1) > d.cpu()["capacity_bytes"]
    gen = torch.Generator().manual_seed(13)
    kv = random_kv(layout, [16, 9], gen)
    tokens = random_tokens(gen, 2 * TOKENS_PER_CHUNK + 3)
    chunks = layout.plan(tokens, [list(range(9)), list(range(9))])
    small = [c for c in chunks if c.group == 0]
    huge = [c for c in chunks if c.group == 1]
    assert len(small) == len(huge) == 2
    expected = {c.key: chunk_pages(layout, kv, c) for c in small}

    with KVTierClient.connect(d.address, layout=layout, kv_caches=kv) as client:
        # one PUT batch: the huge items fail alone, their neighbours are stored
        assert client.store(chunks).result(timeout=30) == [True, True, False, False]
        assert client.store(huge).result(timeout=30) == [False, False]
        cpu = d.cpu()
        assert cpu["chunks"] == 2 and cpu["pending_chunks"] == 0
        assert cpu["used_bytes"] == cpu["committed_bytes"]
        assert client.lookup(chunks) == [True, True, False, False]
        poison(kv)
        assert client.load(chunks).result(timeout=30) == [True, True, False, False]
        for chunk in small:
            assert_chunk_equals(layout, kv, chunk, expected[chunk.key], "beside a huge chunk")
        assert_untouched_outside(layout, kv, small)
    d.check()
    assert d.alive()



class _Staging:
    """A raw client's memfd staging buffer (handed over by the handshake) the test reads back."""

    def __init__(self, nbytes: int) -> None:
        self.buf = MemfdBuffer(nbytes)
        self.map = memoryview((ctypes.c_char * nbytes).from_address(self.buf.address)).cast("B")
        self.nbytes = nbytes

    def hello(self, raw: RawClient, address: str) -> None:
        rep, _ = raw.request(Op.HELLO, namespace="doomed", rank=0, world_size=1, fingerprint="fp",
                             staging=self.buf.hello_staging(address))
        assert rep["status"] == Status.OK, rep

    def close(self) -> None:
        self.map.release()
        self.buf.close()


def _send(raw: RawClient, request_id: int, op: Op, **fields) -> None:
    raw.send_frames([msgpack.packb({"v": PROTOCOL_VERSION, "op": int(op), "id": request_id,
                                    "secret": raw.secret, **fields})])


def _replies(raw: RawClient, ids: set[int]) -> dict[int, dict]:
    out = {}
    while set(out) != ids:
        header, _ = raw.recv()
        out[header["id"]] = header
    return out


def test_delete_and_reuse_while_a_get_copies_never_corrupts_the_reader(daemon_factory):
    """A chunk deleted while its GET copy runs keeps its pages until the copy ends (doomed):
    a PUT that wants those pages must not get them, whatever order the three requests land in."""
    d = daemon_factory(cpu_bytes="48MiB", page_bytes="64KiB", nvme_bytes="0")
    chunk, count = 4 * 1024**2 + 123, 8  # 520 of 768 pages: a second set cannot fit beside it
    region = count * chunk
    a, b = _Staging(2 * region), _Staging(region)
    ra, rb = RawClient(d.address), RawClient(d.address)
    try:
        a.hello(ra, d.address)
        b.hello(rb, d.address)
        for round_ in range(4):
            keys = [b"r%d-a%d" % (round_, i) for i in range(count)]
            other = [b"r%d-b%d" % (round_, i) for i in range(count)]
            data = os.urandom(region)
            a.map[:region] = data
            b.map[:region] = os.urandom(region)
            _send(ra, 1, Op.PUT, items=[[k, i * chunk, chunk] for i, k in enumerate(keys)])
            assert _replies(ra, {1})[1]["results"] == [Status.OK] * count
            a.map[region:] = bytes([POISON]) * region
            # GET (A) | DELETE then PUT into the freed room (B), all in flight together
            _send(ra, 2, Op.GET, items=[[k, region + i * chunk, chunk] for i, k in enumerate(keys)])
            _send(rb, 3, Op.DELETE, keys=keys)
            _send(rb, 4, Op.PUT, items=[[k, i * chunk, chunk] for i, k in enumerate(other)])
            got = _replies(ra, {2})[2]["results"]
            b_replies = _replies(rb, {3, 4})
            assert b_replies[3]["results"] == [Status.OK] * count, b_replies[3]
            for i, status in enumerate(got):
                piece = a.map[region + i * chunk: region + (i + 1) * chunk]
                if status == Status.OK:
                    assert piece == data[i * chunk:(i + 1) * chunk], \
                        f"round {round_} item {i}: a GET hit returned other bytes"
                else:
                    assert status == Status.MISS and piece == bytes([POISON]) * chunk, (i, status)
            assert set(b_replies[4]["results"]) <= {Status.OK, Status.NO_SPACE}, b_replies[4]
            cpu = d.cpu()
            assert cpu["doomed_chunks"] == 0 and cpu["used_bytes"] == cpu["committed_bytes"]
            d.check()
            _send(rb, 5, Op.DELETE, keys=other)
            _replies(rb, {5})
    finally:
        ra.close()
        rb.close()
        a.close()
        b.close()
