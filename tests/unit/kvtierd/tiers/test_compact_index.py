"""The compact index under a real CpuTier: memory per chunk, compact <-> active, eviction order
across both forms, batched lookups, multi-run chunks, restart from the persistent index."""

from __future__ import annotations

import gc
import random
import tracemalloc
import uuid

import pytest
import xxhash

from kvtierd.protocol import Status
from kvtierd.tiers.arena import Arena
from kvtierd.tiers.base import MISMATCH_SLOT, MISS_SLOT
from kvtierd.tiers.chunk import ChunkState
from kvtierd.tiers.cpu import CpuTier
from kvtierd.tiers.index_db import ChunkIndexDB

SPACE = ("uid:1000", "ns", 0)
OTHER = ("uid:2000", "ns", 0)


@pytest.fixture
def make_arena(request):
    def make(nbytes: int) -> Arena:
        arena = Arena(name=f"kvtierd-test-{uuid.uuid4().hex}", nbytes=nbytes, prefault=False,
                      lock=False)
        request.addfinalizer(lambda: arena.close(unlink=True))
        return arena

    return make


def put(tier: CpuTier, space, key: bytes, nbytes: int, rng: random.Random, fp: str = "fp"):
    status, entry = tier.reserve((space, key), fp, nbytes, owner=1)
    assert status is Status.OK, status
    payload = rng.randbytes(nbytes)
    pos = 0
    for offset, length in tier.segments(entry):
        tier.arena.view[offset:offset + length] = payload[pos:pos + length]
        pos += length
    tier.commit(entry, xxhash.xxh3_128_digest(payload))
    return entry, payload


def read(tier: CpuTier, entry) -> bytes:
    return b"".join(bytes(tier.arena.view[o:o + n]) for o, n in tier.segments(entry))


def test_memory_per_indexed_chunk_is_at_most_256_bytes(make_arena):
    """What the index holds per idle chunk (its key bytes included: the request's key object is
    what the index keeps), measured by tracemalloc over 60k chunks."""
    n, page = 60_000, 64
    tier = CpuTier(make_arena(n * page), page)
    rng = random.Random(12)
    sums = [rng.randbytes(16) for _ in range(n)]
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(n):
            _, entry = tier.reserve((SPACE, rng.randbytes(32)), "fp", page, owner=1)
            tier.commit(entry, sums[i])
            if i % 512 == 0:
                tier.compact()
        tier.compact()
        gc.collect()
        per_chunk = (tracemalloc.get_traced_memory()[0] - base) / n
    finally:
        tracemalloc.stop()
    assert len(tier.index) == n and not tier.index.active
    assert 100 < per_chunk <= 256, f"{per_chunk:.0f} bytes per indexed chunk"


def test_compact_to_active_and_back_keeps_state_and_identity(make_arena):
    rng = random.Random(1)
    tier = CpuTier(make_arena(16 * 4096), 4096)
    entry, payload = put(tier, SPACE, b"a", 5000, rng)
    assert tier.compact() == 1 and not tier.index.active  # idle READY: columns only
    status, found = tier.lookup((SPACE, b"a"), "fp")
    assert status is Status.OK and found is not entry and found.state is ChunkState.READY
    assert tier.index.get((SPACE, b"a")) is found  # the same object until the next compact
    assert read(tier, found) == payload and found.checksum == entry.checksum
    found.on_nvme, found.verified = True, False
    tier.pin(found)
    assert tier.compact() == 0 and tier.index.holds(found)  # pinned: stays an object
    tier.acquire(found)
    tier.unpin(found)
    assert tier.compact() == 0  # still referenced
    tier.release(found)
    assert tier.compact() == 1 and not tier.index.active
    again = tier.index[(SPACE, b"a")]
    assert again is not found and again.on_nvme and not again.verified  # written back
    assert again.runs == entry.runs and again.nbytes == 5000 and read(tier, again) == payload
    tier.check_invariants()


def test_eviction_order_is_lru_across_both_forms(make_arena):
    rng = random.Random(2)
    evicted = []
    tier = CpuTier(make_arena(8 * 4096), 4096, on_evict=lambda e: evicted.append(e.ikey[1]))
    for key in b"abcdefgh":
        put(tier, SPACE, bytes([key]), 4096, rng)
    tier.compact()
    tier.lookup((SPACE, b"b"), "fp")  # active again and most recent
    tier.lookup_slots(SPACE, [b"c", b"a"], "fp")  # compact, touched in this order
    pinned = tier.index[(SPACE, b"d")]  # made active without a touch: now the coldest
    tier.pin(pinned)  # but leased
    assert tier.evict(5) == 5
    assert evicted == [b"e", b"f", b"g", b"h", b"b"]
    tier.compact()
    tier.unpin(pinned)
    assert tier.evict(3) == 3
    assert evicted[5:] == [b"d", b"c", b"a"]  # the unpinned one kept its old place
    assert len(tier.index) == 0
    tier.check_invariants()


def test_fingerprint_covers_all_follows_every_chunk_of_the_index(make_arena):
    """The O(1) layout check of a batched lookup: true only while every indexed chunk (compact,
    active or PENDING) has the reader's fingerprint."""
    rng = random.Random(5)
    tier = CpuTier(make_arena(16 * 4096), 4096)
    index = tier.index
    assert not index.fingerprint_covers_all(index.fingerprint_id("fp"))  # nothing indexed
    put(tier, SPACE, b"a", 100, rng)
    put(tier, OTHER, b"b", 100, rng)
    tier.compact()
    assert index.fingerprint_covers_all(index.fingerprint_id("fp"))
    put(tier, SPACE, b"c", 100, rng, fp="fp2")
    assert not index.fingerprint_covers_all(index.fingerprint_id("fp"))
    assert tier.lookup_slots(SPACE, [b"a", b"c"], "fp")[1] == MISMATCH_SLOT
    tier.delete((SPACE, b"c"))
    assert index.fingerprint_covers_all(index.fingerprint_id("fp"))
    assert index.fingerprint_id("fp2") == -1
    status, pending = tier.reserve((SPACE, b"p"), "fp2", 100, owner=1)
    assert status is Status.OK
    assert not index.fingerprint_covers_all(index.fingerprint_id("fp"))
    assert tier.lookup_slots(SPACE, [b"p", b"a"], "fp2")[0] == MISS_SLOT  # PENDING: invisible
    tier.abort(pending)
    assert index.fingerprint_covers_all(index.fingerprint_id("fp"))
    tier.check_invariants()


def test_lookup_slots_matches_per_key_lookups_on_random_batches(make_arena):
    """The batched lookup (C-loop fast path or per-key slow path) answers and touches exactly as
    one lookup per key: the same slots, the same mismatch count, the same eviction order."""
    rng = random.Random(9)
    tiers = [CpuTier(make_arena(64 * 4096), 4096) for _ in range(2)]
    batched, single = tiers
    names = [bytes([k]) * 4 for k in range(40)]
    for i, key in enumerate(names[:30]):
        for tier in tiers:
            put(tier, SPACE, key, 100, random.Random(i), fp="fp2" if i % 10 == 9 else "fp")
    for round_ in range(30):
        if round_ == 15:  # from here on one layout only: the O(1) check applies
            for tier in tiers:
                for i in (9, 19, 29):
                    tier.delete((SPACE, names[i]))
        for tier in tiers:
            tier.compact()
        batch = [rng.choice(names) for _ in range(rng.randint(1, 20))]
        slots = batched.lookup_slots(SPACE, batch, "fp")
        expected = []
        for key in batch:
            status, entry = single.lookup((SPACE, key), "fp")
            expected.append(entry.slot if entry is not None else
                            MISMATCH_SLOT if status is Status.LAYOUT_MISMATCH else MISS_SLOT)
        assert slots == expected
        assert batched.counters["layout_mismatch"] == single.counters["layout_mismatch"]
    order = [list(t.victim_slots(10_000)[0]) for t in tiers]
    assert order[0] == order[1]
    for tier in tiers:
        tier.check_invariants()


def test_lookup_slots_check_sees_the_misses_and_can_refuse_before_any_touch(make_arena):
    """The LOOKUP handler validates only the keys that missed, through ``check``: it sees a slot
    per indexed key (MISS_SLOT otherwise) and, when it raises, nothing was touched or counted."""
    rng = random.Random(4)
    tier = CpuTier(make_arena(8 * 4096), 4096)
    for key in (b"a", b"b", b"c"):
        put(tier, SPACE, key, 100, rng)
    put(tier, SPACE, b"m", 100, rng, fp="fp2")
    tier.compact()
    before = list(tier.victim_slots(10_000)[0])
    seen = []

    def refuse(slots):
        seen.append(list(slots))
        raise ValueError("refused")

    with pytest.raises(ValueError):
        tier.lookup_slots(SPACE, [b"a", b"x", b"m"], "fp", refuse)
    assert seen[0][0] >= 0 and seen[0][1] == MISS_SLOT and seen[0][2] >= 0  # before the checks
    assert list(tier.victim_slots(10_000)[0]) == before and not tier.counters["layout_mismatch"]
    with pytest.raises(ValueError):
        tier.lookup_slots(OTHER, [b"a"], "fp", refuse)  # a space with no chunks: all misses
    assert seen[1] == [MISS_SLOT]
    slots = tier.lookup_slots(SPACE, [b"a", b"x", b"m"], "fp", seen.append)
    assert slots[1:] == [MISS_SLOT, MISMATCH_SLOT] and list(tier.victim_slots(10_000)[0]) != before
    assert tier.lookup_slots(SPACE, [b"b", b"m"], "fp", refuse)[1] == MISMATCH_SLOT  # all
    assert len(seen) == 3  # indexed: nothing to validate, ``check`` not called
    tier.check_invariants()


def test_lookup_slots_answers_like_lookup(make_arena):
    rng = random.Random(3)
    tier = CpuTier(make_arena(16 * 4096), 4096)
    put(tier, SPACE, b"ready", 100, rng)
    put(tier, SPACE, b"other-layout", 100, rng, fp="fp2")
    tier.reserve((SPACE, b"pending"), "fp", 100, owner=1)
    tier.compact()
    slots = tier.lookup_slots(SPACE, [b"ready", b"pending", b"other-layout", b"absent"], "fp")
    assert slots[0] >= 0 and slots[1:] == [MISS_SLOT, MISMATCH_SLOT, MISS_SLOT]
    assert tier.counters["layout_mismatch"] == 1
    assert tier.lookup_slots(OTHER, [b"ready"], "fp") == [MISS_SLOT]  # another tenant's space
    assert tier.index.entry(slots[0]).ikey == (SPACE, b"ready")
    tier.check_invariants()


def test_fragmented_chunks_survive_compaction(make_arena):
    rng = random.Random(4)
    tier = CpuTier(make_arena(8 * 4096), 4096)
    for key in b"abcdefgh":
        put(tier, SPACE, bytes([key]), 4096, rng)
    for key in b"bdf":  # holes of one page each
        assert tier.delete((SPACE, bytes([key]))) is Status.OK
    entry, payload = put(tier, SPACE, b"frag", 3 * 4096, rng)
    assert len(entry.runs) == 3
    tier.compact()
    again = tier.index[(SPACE, b"frag")]
    assert again.runs == entry.runs and read(tier, again) == payload
    tier.check_invariants()


def test_restart_indexes_rows_compactly_and_in_row_order(make_arena, tmp_path):
    rng = random.Random(5)
    arena = make_arena(32 * 4096)
    tier = CpuTier(arena, 4096)
    tier.attach_index(ChunkIndexDB(tmp_path / "index", {"page_bytes": "4096"}), attached=False)
    stored = {}
    for i in range(10):
        entry, payload = put(tier, SPACE if i % 2 else OTHER, b"k%d" % i, 4096 * (1 + i % 3), rng)
        stored[entry.ikey] = (entry.runs, payload, entry.checksum)
    tier.delete((SPACE, b"k3"))
    del stored[(SPACE, b"k3")]
    tier.db.close()

    again = CpuTier(arena, 4096)
    assert again.attach_index(ChunkIndexDB(tmp_path / "index", {"page_bytes": "4096"}),
                              attached=True) == len(stored)
    assert not again.index.active  # recovered straight into columns
    again.check_invariants()
    for ikey, (runs, payload, checksum) in stored.items():
        entry = again.index[ikey]
        assert entry.runs == runs and entry.checksum == checksum and not entry.verified
        assert read(again, entry) == payload
    assert again.used_bytes == 4096 * sum(c for runs, _, _ in stored.values() for _, c in runs)
    status, entry = again.reserve((SPACE, b"new"), "fp", 4096, owner=1)  # allocator is right
    assert status is Status.OK and not set(entry.runs) & {r for v in stored.values() for r in v[0]}
    again.abort(entry)
    again.check_invariants()
    again.db.close()


def test_invariants_catch_a_drifted_column(make_arena):
    rng = random.Random(6)
    tier = CpuTier(make_arena(8 * 4096), 4096)
    put(tier, SPACE, b"a", 100, rng)
    put(tier, SPACE, b"b", 100, rng)
    tier.compact()
    tier.index._keys[0] = b"zz"  # a slot no longer holds the key its space maps to it
    with pytest.raises(AssertionError, match="does not hold"):
        tier.check_invariants()
    tier.index._keys[0] = b"a"
    tier.check_invariants()
