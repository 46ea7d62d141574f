"""The CPU tier's batch primitives (kvtierd.tiers.cpu_batch) against the per-item primitives they
replace on the request path: two tiers over real arenas get the same random scenario, one item by
item and one a batch at a time, and must agree on every status, every page, the eviction order and
every counter, with check_invariants() after each step."""

import random
import uuid

import pytest
import xxhash

from kvtierd.protocol import Status
from kvtierd.tiers.allocator import PageAllocator
from kvtierd.tiers.arena import Arena
from kvtierd.tiers.chunk import ChunkState
from kvtierd.tiers.cpu import CpuTier

PAGE = 4096
PAGES = 64
SPACE = ("uid:1000", "ns", 0)
OTHER = ("uid:1000", "ns", 1)


@pytest.fixture
def pair(request):
    tiers = []
    for _ in range(2):
        arena = Arena(name=f"kvtierd-test-{uuid.uuid4().hex}", nbytes=PAGES * PAGE,
                      prefault=False, lock=False)
        request.addfinalizer(lambda arena=arena: arena.close(unlink=True))
        tiers.append(CpuTier(arena, PAGE))
    return tiers


def state(tier: CpuTier) -> tuple:
    """Everything observable about a tier's chunks and counters (entries are not compared by
    identity: one tier built them per item, the other per batch)."""
    tier.compact()
    tier.check_invariants()
    chunks = sorted((ikey, e.state.value, e.nbytes, tuple(e.runs), e.checksum, e.ref_count,
                     e.pin_count, e.verified) for ikey, e in tier.index.items())
    victims = [tier.index.entry(s).ikey for s in tier.policy.victims()]
    tier.compact()
    return (chunks, victims, tier.allocator.free_runs(), tier.pending_chunks, tier.ready_chunks,
            tier.held_pages, dict(tier.tenant_pages), dict(tier.counters))


def payload_of(key: bytes, nbytes: int) -> bytes:
    return random.Random(key).randbytes(nbytes)


def fill(tier, entries):
    digests = []
    for entry in entries:
        data = payload_of(entry.ikey[1], entry.nbytes)
        pos = 0
        for offset, length in tier.segments(entry):
            tier.arena.view[offset:offset + length] = data[pos:pos + length]
            pos += length
        digests.append(xxhash.xxh3_128_digest(data))
    return digests


def put_each(tier, space, keys, sizes, fp="fp"):
    out = [tier.reserve((space, k), fp, n, owner=1) for k, n in zip(keys, sizes)]
    entries = [e for _, e in out if e is not None]
    for entry, digest in zip(entries, fill(tier, entries)):
        tier.commit(entry, digest)
    return [s for s, _ in out]


def put_batch(tier, space, keys, sizes, fp="fp"):
    out = tier.reserve_many(space, keys, sizes, fp, owner=1)
    entries = [e for _, e in out if e is not None]
    tier.commit_many(entries, fill(tier, entries))
    return [s for s, _ in out]


def get_each(tier, space, keys, sizes, fp="fp"):
    out = []
    for key, nbytes in zip(keys, sizes):
        status, entry = tier.lookup((space, key), fp)
        if entry is None:
            out.append(int(status))
        elif entry.nbytes != nbytes:
            out.append(int(Status.SIZE_MISMATCH))
        else:
            tier.acquire(entry)
            out.append(entry)
    return out


def delete_each(tier, space, keys, fp="fp"):
    """What the DELETE handler does per key without lower tiers."""
    out = []
    for key in keys:
        status, _ = tier.lookup((space, key), fp)
        out.append(int(status) if status is Status.LAYOUT_MISMATCH
                   else int(tier.delete((space, key))))
    return out


def random_batch(rng, prefix, n, sizes=(PAGE, 2 * PAGE, 3 * PAGE - 7)):
    keys = [f"{prefix}-{rng.randrange(3 * n)}".encode() for _ in range(n)]  # repeats on purpose
    size = rng.choice(sizes)
    return keys, [size if rng.random() < 0.9 else rng.choice(sizes) for _ in keys]


@pytest.mark.parametrize("seed", range(6))
def test_batches_match_per_item_primitives(pair, seed):
    rng = random.Random(seed)
    each, batch = pair
    for step in range(40):
        keys, sizes = random_batch(rng, f"k{step % 5}", rng.randint(1, 12))
        space = SPACE if rng.random() < 0.8 else OTHER
        fp = "fp" if rng.random() < 0.85 else "fp-other"
        op = rng.choice(["put", "put", "get", "delete"])
        if op == "put":
            assert put_each(each, space, keys, sizes, fp) == put_batch(batch, space, keys, sizes, fp)
        elif op == "get":
            a = get_each(each, space, keys, sizes, fp)
            b = batch.acquire_many(space, keys, sizes, fp)
            assert [x if type(x) is int else "hit" for x in a] == [
                x if type(x) is int else "hit" for x in b]
            hits_a = [e for e in a if type(e) is not int]
            hits_b = [e for e in b if type(e) is not int]
            for entry in hits_b:  # the bytes under each acquired entry are the ones put
                data = b"".join(bytes(batch.arena.view[o:o + n]) for o, n in batch.segments(entry))
                assert data == payload_of(entry.ikey[1], entry.nbytes)
            for entry in hits_a:
                each.release(entry)
            assert batch.release_read(hits_b) == sum(e.nbytes for e in hits_b)
        else:
            assert delete_each(each, space, keys, fp) == batch.delete_many(space, keys, fp)
        assert state(each) == state(batch), f"step {step} ({op}) diverged"


def test_reserve_many_evicts_like_reserve_when_full(pair):
    """A full arena: reserve_many's one-pass allocation runs out, the rest goes one by one
    through reserve's eviction, and the result is the same as all one by one."""
    each, batch = pair
    for tier, put in ((each, put_each), (batch, put_batch)):
        keys = [f"old-{i}".encode() for i in range(PAGES)]
        assert put(tier, SPACE, keys, [PAGE] * PAGES) == [Status.OK] * PAGES
        tier.delete((SPACE, b"old-3"))  # a one-page hole: fragmentation
        new = [f"new-{i}".encode() for i in range(10)]
        assert put(tier, SPACE, new, [2 * PAGE] * 10) == [Status.OK] * 10
    assert state(each) == state(batch)
    assert batch.counters["evictions"] >= 10 and batch.counters["evictions"] == each.counters[
        "evictions"]
    assert all((SPACE, f"new-{i}".encode()) in batch.index for i in range(10))


def test_delete_many_dooms_a_chunk_being_read(pair):
    _, tier = pair
    put_batch(tier, SPACE, [b"a", b"b"], [PAGE, PAGE])
    [entry, _] = tier.acquire_many(SPACE, [b"a", b"b"], [PAGE, PAGE], "fp")
    tier.release_read([_])
    free_before = tier.allocator.free_pages
    assert tier.delete_many(SPACE, [b"a", b"b", b"a"], "fp") == [0, 0, int(Status.MISS)]
    assert entry.doomed and tier.allocator.free_pages == free_before + 1  # a's pages still held
    tier.check_invariants()
    tier.release_read([entry])
    assert tier.allocator.free_pages == PAGES and len(tier.index) == 0
    tier.check_invariants()


def test_delete_many_leaves_pending_and_other_layouts(pair):
    _, tier = pair
    put_batch(tier, SPACE, [b"ready"], [PAGE], fp="fp")
    [(status, pending)] = tier.reserve_many(SPACE, [b"pending"], [PAGE], "fp", owner=1)
    assert status is Status.OK and pending.state is ChunkState.PENDING
    assert tier.delete_many(SPACE, [b"pending", b"ready", b"none"], "fp-other") == [
        int(Status.BUSY), int(Status.LAYOUT_MISMATCH), int(Status.MISS)]
    assert tier.counters["layout_mismatch"] == 1 and len(tier.index) == 2
    tier.abort(pending)
    tier.check_invariants()


def test_commit_many_is_one_index_transaction(pair, tmp_path):
    from kvtierd.tiers.index_db import ChunkIndexDB

    _, tier = pair
    db = ChunkIndexDB(tmp_path / "index.sqlite", {"page_bytes": str(PAGE)})
    tier.attach_index(db, attached=False)
    keys = [f"k{i}".encode() for i in range(5)]
    put_batch(tier, SPACE, keys, [PAGE] * 5)
    assert sorted(row.key for row in db.rows()) == sorted(keys)
    assert tier.delete_many(SPACE, keys[:3], "fp") == [0, 0, 0]
    assert sorted(row.key for row in db.rows()) == sorted(keys[3:])
    tier.check_invariants()
    db.close()


@pytest.mark.parametrize("seed", range(20))
def test_allocate_many_is_repeated_first_fit(seed):
    rng = random.Random(seed)
    a, b = PageAllocator(200), PageAllocator(200)
    held = []
    for _ in range(30):  # fragment both the same way
        runs = a.allocate(rng.randint(1, 9))
        assert runs == b.allocate(sum(c for _, c in runs))
        held.append(runs)
    for runs in rng.sample(held, 15):
        a.free(runs)
        b.free(runs)
    count, n = rng.randint(1, 6), rng.randint(1, 40)
    one_by_one = []
    for _ in range(n):
        if a.free_pages < count:
            break
        runs = a.allocate(count)
        if len(runs) != 1:  # would need several runs: allocate_many stops before it
            a.free(runs)
            break
        one_by_one.extend(runs)
    assert b.allocate_many(count, n) == one_by_one
    assert a.free_runs() == b.free_runs() and a.free_pages == b.free_pages
    b.check_invariants()


def test_entry_init_takes_every_field():
    """ChunkEntry's __init__ is written out (kvtierd.tiers.chunk): a field added to the class
    must be added there too."""
    import dataclasses
    import inspect

    from kvtierd.tiers.chunk import ChunkEntry

    params = set(inspect.signature(ChunkEntry.__init__).parameters) - {"self"}
    assert params == {f.name for f in dataclasses.fields(ChunkEntry) if f.init}
    entry = ChunkEntry(("s", b"k"), "fp", 5000, [(3, 1), (9, 1)], owner=2)
    assert (entry.pages, entry.state, entry.slot, entry.verified) == (2, ChunkState.PENDING, -1, True)


def test_single_run_segments_shortcut_matches_the_general_one(pair):
    from kvtierd.tiers.chunk import segments

    tier = pair[0]
    rng = random.Random(5)
    for _ in range(200):
        nbytes = rng.randint(1, 6 * PAGE)
        status, entry = tier.reserve((SPACE, b"seg"), "fp", nbytes, owner=1)
        assert status is Status.OK
        assert tier.segments(entry) == segments(entry.runs, entry.nbytes, PAGE)
        tier.abort(entry)
