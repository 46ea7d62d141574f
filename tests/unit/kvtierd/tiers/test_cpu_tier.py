"""CpuTier over a real shared-memory Arena: states, refusals, eviction, dooming, intact bytes."""

import random
import uuid

import pytest
import xxhash

from kvtierd.protocol import Status
from kvtierd.tiers.arena import SHM_DIR, Arena
from kvtierd.tiers.chunk import ChunkState
from kvtierd.tiers.cpu import CpuTier

PAGE = 4096
PAGES = 16
SPACE = ("uid:1000", "ns", 0)  # (tenant, namespace, rank)


@pytest.fixture
def arena(request):
    name = f"kvtierd-test-{uuid.uuid4().hex}"
    arena = Arena(name=name, nbytes=PAGES * PAGE, prefault=False, lock=False)
    assert (SHM_DIR / name).exists()

    def close():
        arena.close(unlink=True)
        assert not (SHM_DIR / name).exists()

    request.addfinalizer(close)
    return arena


@pytest.fixture
def evicted():
    return []


@pytest.fixture
def tier(arena, evicted):
    tier = CpuTier(arena, PAGE, on_evict=lambda e: evicted.append(e.ikey[1]))
    yield tier
    tier.check_invariants()


def write(tier, entry, payload: bytes) -> None:
    pos = 0
    for offset, length in tier.segments(entry):
        tier.arena.view[offset : offset + length] = payload[pos : pos + length]
        pos += length
    assert pos == len(payload)


def read(tier, entry) -> bytes:
    return b"".join(bytes(tier.arena.view[o : o + n]) for o, n in tier.segments(entry))


def put(tier, key: bytes, nbytes: int, rng, fp="fp"):
    status, entry = tier.reserve((SPACE, key), fp, nbytes, owner=1)
    assert status is Status.OK, status
    payload = rng.randbytes(nbytes)
    write(tier, entry, payload)
    tier.commit(entry, xxhash.xxh3_128_digest(payload))
    return entry, payload


def get(tier, key: bytes, fp="fp"):
    status, entry = tier.lookup((SPACE, key), fp)
    return status, entry


def test_reserve_commit_lookup(tier):
    rng = random.Random(1)
    status, entry = tier.reserve((SPACE, b"a"), "fp", 3 * PAGE + 5, owner=7)
    assert status is Status.OK and entry.state is ChunkState.PENDING and entry.pages == 4
    assert get(tier, b"a") == (Status.MISS, None)  # PENDING is invisible
    payload = rng.randbytes(3 * PAGE + 5)
    write(tier, entry, payload)
    tier.commit(entry, xxhash.xxh3_128_digest(payload))
    status, found = get(tier, b"a")
    assert status is Status.OK and found is entry and entry.state is ChunkState.READY
    assert read(tier, found) == payload
    assert found.checksum == xxhash.xxh3_128_digest(payload)
    assert get(tier, b"a", fp="other") == (Status.LAYOUT_MISMATCH, None)
    assert get(tier, b"zz") == (Status.MISS, None)


def test_reserve_of_existing_key(tier):
    rng = random.Random(2)
    put(tier, b"a", 2 * PAGE, rng)
    assert tier.reserve((SPACE, b"a"), "fp", 2 * PAGE, 1) == (Status.EXISTS, None)
    assert tier.reserve((SPACE, b"a"), "fp2", 2 * PAGE, 1) == (Status.LAYOUT_MISMATCH, None)
    assert tier.reserve((SPACE, b"a"), "fp", 2 * PAGE - 1, 1) == (Status.SIZE_MISMATCH, None)
    status, pending = tier.reserve((SPACE, b"b"), "fp", PAGE, 2)
    assert status is Status.OK
    assert tier.reserve((SPACE, b"b"), "fp", PAGE, 3) == (Status.BUSY, None)
    assert tier.reserve((SPACE, b"b"), "fp2", PAGE, 3) == (Status.LAYOUT_MISMATCH, None)
    assert tier.delete((SPACE, b"b")) is Status.BUSY
    assert tier.counters["layout_mismatch"] == 2
    assert tier.reserve((SPACE, b"big"), "fp", PAGES * PAGE + 1, 1) == (Status.TOO_LARGE, None)
    tier.check_invariants()
    tier.abort(pending)


def test_slack_is_one_run_of_free_pages_and_is_freed_at_commit(tier):
    """A promotion target may get room after its payload (a remote read lands the object's
    trailing header there): only as one run of free pages, never by evicting, and the spare
    pages go back at commit (abort frees them with the rest)."""
    rng = random.Random(3)
    status, entry = tier.reserve((SPACE, b"a"), "fp", 2 * PAGE, 1, slack=84)
    assert status is Status.OK and entry.runs == [(0, 3)] and tier.allocator.free_pages == 13
    tier.check_invariants()
    payload = rng.randbytes(2 * PAGE)
    write(tier, entry, payload)
    tier.commit(entry, xxhash.xxh3_128_digest(payload))
    assert entry.runs == [(0, 2)] and entry.pages == 2 and tier.allocator.free_pages == 14
    assert tier.stats()["used_bytes"] == 2 * PAGE and read(tier, entry) == payload
    tier.check_invariants()
    status, inside = tier.reserve((SPACE, b"b"), "fp", PAGE - 100, 1, slack=84)
    assert inside.pages == 1  # the room after the payload is in its last page already
    tier.abort(inside)
    status, aborted = tier.reserve((SPACE, b"c"), "fp", PAGE, 1, slack=84)
    assert aborted.pages == 2
    tier.abort(aborted)
    assert tier.allocator.free_pages == 14
    for i in range(6):  # fill up, then free three holes of two pages
        put(tier, b"f%d" % i, 2 * PAGE, rng)
    put(tier, b"g", 2 * PAGE, rng)
    for i in range(0, 6, 2):
        tier.delete((SPACE, b"f%d" % i))
    assert tier.allocator.free_runs() == [(2, 2), (6, 2), (10, 2)]
    status, tight = tier.reserve((SPACE, b"t"), "fp", 2 * PAGE, 1, slack=84)
    assert status is Status.OK and tight.pages == 2 and tight.runs == [(2, 2)]  # no run of 3
    tier.abort(tight)
    tier.check_invariants()


def test_abort_frees_pages(tier):
    status, entry = tier.reserve((SPACE, b"a"), "fp", 5 * PAGE, 1)
    assert status is Status.OK and tier.allocator.free_pages == PAGES - 5
    assert tier.stats()["pending_bytes"] == 5 * PAGE
    tier.check_invariants()
    tier.abort(entry)
    assert tier.allocator.free_pages == PAGES and tier.allocator.free_runs() == [(0, PAGES)]
    assert get(tier, b"a") == (Status.MISS, None)
    assert tier.stats()["pending_chunks"] == 0 and tier.counters["aborts"] == 1
    assert tier.reserve((SPACE, b"a"), "fp2", PAGE, 1)[0] is Status.OK  # key is free again


def test_eviction_follows_lru_and_touch(tier, evicted):
    rng = random.Random(3)
    data = {k: put(tier, k, 4 * PAGE, rng)[1] for k in (b"a", b"b", b"c", b"d")}
    assert tier.allocator.free_pages == 0
    assert get(tier, b"a")[0] is Status.OK  # a is now the most recent
    put(tier, b"e", 4 * PAGE, rng)
    assert evicted == [b"b"]
    assert tier.reserve((SPACE, b"c"), "fp", 4 * PAGE, 1)[0] is Status.EXISTS  # also a touch
    put(tier, b"f", 8 * PAGE, rng)
    assert evicted == [b"b", b"d", b"a"]
    assert get(tier, b"c")[0] is Status.OK and get(tier, b"a") == (Status.MISS, None)
    assert read(tier, get(tier, b"c")[1]) == data[b"c"]
    assert tier.counters["evictions"] == 3
    tier.check_invariants()


def test_pinned_and_acquired_are_never_evicted(tier, evicted):
    rng = random.Random(4)
    entries = {k: put(tier, k, 4 * PAGE, rng)[0] for k in (b"a", b"b", b"c", b"d")}
    tier.pin(entries[b"a"])
    tier.acquire(entries[b"b"])
    tier.pin(entries[b"c"])
    tier.acquire(entries[b"d"])
    assert tier.reserve((SPACE, b"e"), "fp", PAGE, 1) == (Status.NO_SPACE, None)
    assert evicted == [] and tier.counters["reserve_no_space"] == 1
    assert tier.enforce_watermarks() == 0 and evicted == []
    tier.check_invariants()
    tier.unpin(entries[b"c"])
    tier.release(entries[b"d"])
    put(tier, b"e", 2 * PAGE, rng)
    assert evicted == [b"c"]  # c is colder than d; a and b stay
    assert all(get(tier, k)[0] is Status.OK for k in (b"a", b"b", b"d"))
    tier.release(entries[b"b"])
    tier.unpin(entries[b"a"])


def test_pending_chunks_are_never_evicted(tier, evicted):
    status, pending = tier.reserve((SPACE, b"p"), "fp", PAGES * PAGE, 1)
    assert status is Status.OK
    assert tier.reserve((SPACE, b"q"), "fp", 1, 1) == (Status.NO_SPACE, None)
    assert evicted == []
    tier.abort(pending)


def test_no_space_reserve_evicts_nothing(tier, evicted):
    rng = random.Random(5)
    entries = [put(tier, k, 4 * PAGE, rng)[0] for k in (b"a", b"b", b"c", b"d")]
    tier.pin(entries[0])
    tier.pin(entries[1])
    assert tier.reserve((SPACE, b"big"), "fp", 12 * PAGE, 1) == (Status.NO_SPACE, None)
    assert evicted == []  # c and d could not make 12 pages: dropping them gains nothing


def test_delete_of_acquired_entry_dooms_it(tier):
    rng = random.Random(6)
    entry, payload = put(tier, b"a", 6 * PAGE, rng)
    tier.acquire(entry)
    assert tier.delete((SPACE, b"a")) is Status.OK
    assert tier.delete((SPACE, b"a")) is Status.MISS
    assert get(tier, b"a") == (Status.MISS, None) and entry.doomed
    stats = tier.stats()
    assert stats["doomed_chunks"] == 1 and stats["chunks"] == 0
    assert stats["used_bytes"] == 6 * PAGE and stats["committed_bytes"] == 0
    tier.check_invariants()
    other, _ = put(tier, b"b", 10 * PAGE, rng)  # fills the rest
    tier.pin(other)
    assert tier.reserve((SPACE, b"c"), "fp", 1, 1)[0] is Status.NO_SPACE  # doomed pages stay taken
    assert read(tier, entry) == payload  # the reader still sees its bytes
    tier.release(entry)
    assert tier.allocator.free_pages == 6 and tier.stats()["doomed_chunks"] == 0
    tier.unpin(other)
    tier.check_invariants()


def test_delete_of_pinned_entry_frees_at_once(tier):
    rng = random.Random(7)
    entry, _ = put(tier, b"a", 3 * PAGE, rng)
    tier.pin(entry)
    assert tier.delete((SPACE, b"a")) is Status.OK
    assert tier.allocator.free_pages == PAGES and tier.stats()["doomed_chunks"] == 0
    tier.unpin(entry)


def test_enforce_watermarks_evicts_to_low(arena, evicted):
    tier = CpuTier(arena, PAGE, high_watermark=0.75, low_watermark=0.5,
                   on_evict=lambda e: evicted.append(e.ikey[1]))
    rng = random.Random(8)
    for i in range(12):
        put(tier, bytes([i]), PAGE, rng)
    assert tier.enforce_watermarks() == 0 and evicted == []  # 12 pages == high, not above
    put(tier, b"x", PAGE, rng)
    assert tier.enforce_watermarks() == 5
    assert evicted == [bytes([i]) for i in range(5)]
    assert PAGES - tier.allocator.free_pages == 8
    assert tier.enforce_watermarks() == 0
    tier.check_invariants()


def test_stats_match(tier):
    rng = random.Random(9)
    a, _ = put(tier, b"a", 2 * PAGE + 1, rng)  # 3 pages
    put(tier, b"b", 1, rng)  # 1 page
    status, pending = tier.reserve((SPACE, b"c"), "fp", 4 * PAGE, 1)
    tier.delete((SPACE, b"b"))
    assert tier.stats() == {
        "capacity_bytes": PAGES * PAGE,
        "used_bytes": 7 * PAGE,
        "committed_bytes": 3 * PAGE,
        "pending_bytes": 4 * PAGE,
        "chunks": 1,
        "pending_chunks": 1,
        "doomed_chunks": 0,
        "demoting_bytes": 0,
        "commits": 2,
        "deletes": 1,
    }
    tier.abort(pending)


@pytest.mark.parametrize("seed", range(4))
def test_random_workload_serves_only_right_bytes(arena, seed):
    rng = random.Random(seed)
    stored: dict[bytes, bytes] = {}
    held: dict[bytes, tuple] = {}  # key -> (entry, "pin" | "ref")

    def on_evict(entry):
        assert entry.ikey[1] not in held, "evicted a pinned or acquired chunk"
        del stored[entry.ikey[1]]

    tier = CpuTier(arena, PAGE, on_evict=on_evict)
    for step in range(300):
        key = bytes([rng.randrange(24)])
        action = rng.random()
        if action < 0.5 and key not in stored:
            status, entry = tier.reserve((SPACE, key), "fp", rng.randint(1, 5 * PAGE), 1)
            if status is Status.OK:
                payload = rng.randbytes(entry.nbytes)
                write(tier, entry, payload)
                if rng.random() < 0.1:
                    tier.abort(entry)
                else:
                    tier.commit(entry, xxhash.xxh3_128_digest(payload))
                    stored[key] = payload
            else:
                assert status is Status.NO_SPACE and held
        elif action < 0.7:
            if key in held:
                entry, how = held.pop(key)
                tier.unpin(entry) if how == "pin" else tier.release(entry)
            elif key in stored:
                entry = get(tier, key)[1]
                how = rng.choice(["pin", "ref"])
                tier.pin(entry) if how == "pin" else tier.acquire(entry)
                held[key] = (entry, how)
        elif action < 0.8 and key in stored and key not in held:
            assert tier.delete((SPACE, key)) is Status.OK
            del stored[key]
        else:
            status, entry = get(tier, key)
            assert status is (Status.OK if key in stored else Status.MISS)
        tier.check_invariants()
        for k, payload in stored.items():
            entry = tier.index[(SPACE, k)]
            assert read(tier, entry) == payload, f"step {step}: chunk {k!r} bytes changed"
            assert entry.checksum == xxhash.xxh3_128_digest(payload)
    assert tier.counters["evictions"] > 0
    for entry, how in held.values():
        tier.unpin(entry) if how == "pin" else tier.release(entry)
    tier.check_invariants()


# -- tenants and quotas ----------------------------------------------------------------------------

def test_quota_evicts_the_tenants_own_coldest_chunks_never_another_tenants(arena, evicted):
    quotas = {"small": 4, "big": 0}  # pages; 0 = no quota
    tier = CpuTier(arena, PAGE, on_evict=lambda e: evicted.append(e.ikey),
                   quota_pages=lambda t: quotas.get(t, 0))
    rng = random.Random(7)

    def put_as(tenant, key, pages):
        status, entry = tier.reserve(((tenant, "ns", 0), key), "fp", pages * PAGE, owner=1)
        if entry is not None:
            write(tier, entry, rng.randbytes(pages * PAGE))
            tier.commit(entry, b"sum")
        return status

    assert put_as("big", b"b0", 2) is Status.OK and put_as("big", b"b1", 2) is Status.OK
    assert put_as("small", b"s0", 2) is Status.OK and put_as("small", b"s1", 2) is Status.OK
    assert tier.tenant_used_pages("small") == 4 and tier.tenant_used_pages("big") == 4
    tier.check_invariants()
    assert put_as("small", b"s2", 2) is Status.OK  # over its quota: its own coldest goes
    assert evicted == [(("small", "ns", 0), b"s0")]
    assert put_as("small", b"s3", 5) is Status.QUOTA_EXCEEDED  # larger than the quota itself
    _, s1 = tier.lookup((("small", "ns", 0), b"s1"), "fp")
    _, s2 = tier.lookup((("small", "ns", 0), b"s2"), "fp")
    tier.pin(s1)
    tier.pin(s2)  # nothing of its own is evictable now
    assert put_as("small", b"s4", 1) is Status.QUOTA_EXCEEDED
    assert evicted == [(("small", "ns", 0), b"s0")], "another tenant's chunk was evicted"
    assert tier.quota_rejections["small"] == 2
    stats = tier.tenant_stats()
    assert stats["small"] == {"used_bytes": 4 * PAGE, "quota_bytes": 4 * PAGE,
                              "quota_rejections": 2}
    assert stats["big"]["used_bytes"] == 4 * PAGE
    tier.check_invariants()
    tier.unpin(s1)
    tier.unpin(s2)
    assert put_as("big", b"b2", 7) is Status.OK  # no quota: the whole free tier
    tier.check_invariants()
    assert tier.delete((("big", "ns", 0), b"b0")) is Status.OK
    tier.check_invariants()


def test_invariants_catch_drifted_tenant_accounting(tier):
    put(tier, b"a", PAGE, random.Random(3))
    tier.tenant_pages["uid:1000"] += 1
    with pytest.raises(AssertionError, match="per-tenant pages drifted"):
        tier.check_invariants()
    tier.tenant_pages["uid:1000"] -= 1
