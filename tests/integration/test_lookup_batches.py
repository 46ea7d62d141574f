"""Batched LOOKUPs through a real daemon touch the LRU exactly as one touch per hit key would:
in key order, duplicates included, whether the batch is all hits (the handler's fast path) or
mixes in misses; the eviction that follows takes the coldest chunks by that order, and every
survivor is served byte-exact. Counts and ghosts see every key once."""

from __future__ import annotations

import random

import pytest
from helpers.bad_input import POISON, Session, names

from kvtierd.protocol import Op

pytestmark = pytest.mark.timeout(90)

PAGE = 16 * 1024
TIER_PAGES = 64  # one-page chunks: eviction starts above 95 % (60 chunks)


def test_lookup_batches_touch_in_key_order_and_eviction_follows(daemon_factory, memfd):
    d = daemon_factory(cpu_bytes=str(TIER_PAGES * PAGE), page_bytes=str(PAGE), nvme_bytes="0")
    rng = random.Random(12)
    first = [f"old-{i}".encode() for i in range(40)]
    later = [f"new-{i}".encode() for i in range(30)]
    count = len(first) + len(later)
    buf = memfd(count * PAGE)
    payload = rng.randbytes(count * PAGE)
    buf.write(0, payload)
    where = {k: i for i, k in enumerate(first + later)}
    a = Session(d.address, "lookups", staging=buf)
    try:
        assert names(a.put([[k, where[k] * PAGE, PAGE] for k in first])["results"]) == (
            ["OK"] * len(first))
        model = list(first)  # coldest first, one touch per hit key
        looked_up = hit_keys = 0
        for step in range(12):
            batch = [rng.choice(first) for _ in range(rng.randint(1, 30))]
            if step % 3 == 2:  # a miss somewhere: the per-key path of the same handler
                batch.insert(rng.randrange(len(batch) + 1), b"never-stored")
            tiers = a.lookup(batch)
            assert tiers == [0 if k == b"never-stored" else 1 for k in batch], (step, tiers)
            for key in batch:
                if key in model:
                    model.remove(key)
                    model.append(key)
                    hit_keys += 1
            looked_up += len(batch)
        counts = d.stats()["counts"]
        assert counts["lookup_hits"] == counts["lookup_hits_cpu"] == hit_keys
        assert counts["lookup_misses"] == looked_up - hit_keys
        assert d.stats()["ghosts"]["cpu"]["accesses"] == looked_up  # a small tier: every key

        for key in later:  # one PUT each: evictions happen along the way, coldest first
            assert names(a.put([[key, where[key] * PAGE, PAGE]])["results"]) == ["OK"]
            model.append(key)
        assert d.cpu()["evictions"] > 0
        alive = [t == 1 for t in a.lookup(model)]
        survivors = alive.index(True)
        assert 0 < survivors and all(alive[survivors:]), (
            "a chunk colder than a survivor (by the batched touches' order) outlived it", alive)

        kept = model[survivors:]
        buf.fill(POISON, 0, count * PAGE)
        reply, _ = a.get([[k, where[k] * PAGE, PAGE] for k in kept])
        assert names(reply["results"]) == ["OK"] * len(kept)
        for key in kept:
            off = where[key] * PAGE
            assert buf.read(off, PAGE) == payload[off:off + PAGE], key
        reply, _ = a.request(Op.LOOKUP, keys=kept, lease=True)  # an all-hit batch, leased
        assert reply["tiers"] == [1] * len(kept)
        d.check()  # raises on a violated invariant (leases and pins agree, LRU consistent)
    finally:
        a.close()
