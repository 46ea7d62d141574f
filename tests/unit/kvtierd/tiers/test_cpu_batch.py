"""The CPU tier's batch primitives (kvtierd.tiers.cpu_batch) against the per-item primitives they
replace on the request path: two tiers over real arenas get the same random scenario, one item by
item and one a batch at a time, and must agree on every status, every page, the eviction order and
every counter, with check_invariants() after each step."""

import random
import uuid

import pytest

from helpers.cpu_pair import (OTHER, PAGE, PAGES, SPACE, Reads, delete_each, fill, get_each,
                              payload_of, put_batch, put_each, python_columns, random_batch,
                              state)
from kvtierd.protocol import Status
from kvtierd.tiers.allocator import PageAllocator
from kvtierd.tiers.arena import Arena
from kvtierd.tiers.chunk import ChunkState
from kvtierd.tiers.cpu import CpuTier


@pytest.mark.parametrize("seed", range(8))
def test_batches_match_per_item_primitives(pair, seed):
    """Random PUT / GET / DELETE batches; a GET's holds are kept over later steps at random
    (deletes and evictions meet chunks held by slot) and released in a random order."""
    rng = random.Random(seed)
    each, batch = pair
    holds: list[Reads] = []
    stored: list[tuple] = []  # (space, distinct keys) of earlier PUT batches
    plain = 0  # DELETE batches of plain chunks only (delete_many's one-pass path)
    for step in range(60):
        keys, sizes = random_batch(rng, f"k{step % 5}", rng.randint(1, 12))
        space = SPACE if rng.random() < 0.8 else OTHER
        fp = "fp" if rng.random() < 0.85 else "fp-other"
        op = rng.choice(["put", "put", "get", "get", "delete", "delete_put", "delete_put",
                         "release"])
        if op == "delete_put" and stored:  # what a PUT stored: distinct keys, mostly idle
            space, keys = stored.pop(rng.randrange(len(stored)))
            keys = rng.sample(keys, rng.randint(1, len(keys)))
            op = "delete"
        if op == "put" and rng.random() < 0.3:  # new, distinct keys: reserve_many's C path
            keys = [f"n{step}-{i}".encode() for i in range(len(keys))]
        if op == "put":
            assert put_each(each, space, keys, sizes, fp) == put_batch(
                batch, space, keys, sizes, fp, fold=seed % 2 == 0)
            stored.append((space, list(dict.fromkeys(keys))))
        elif op == "get":
            reads = Reads(each, batch, space, keys, sizes, fp)
            a, b = reads.outcomes()
            assert a == b
            reads.check_bytes()
            holds.append(reads)
            if rng.random() < 0.5 or len(holds) > 4:
                holds.pop(rng.randrange(len(holds))).release()
        elif op == "release" and holds:
            holds.pop(rng.randrange(len(holds))).release()
        elif op == "delete":
            found = batch.index.key_space(space)
            plain += found is not None and batch.index.plain_slots(
                found, keys, batch.index.fingerprint_id(fp)) is not None
            assert delete_each(each, space, keys, fp) == batch.delete_many(space, keys, fp)
        for reads in holds:  # whatever happened since, held bytes stay the ones put
            reads.check_bytes()
        assert state(each) == state(batch), f"step {step} ({op}) diverged"
    while holds:
        holds.pop().release()
    assert state(each) == state(batch)
    assert not batch.index.reads and not batch.index.retired
    assert plain, "no DELETE batch took the plain path"


@pytest.mark.parametrize("seed", range(3))
def test_the_same_with_the_index_columns_written_by_the_python_loops(pair, seed, monkeypatch):
    """``test_batches_match_per_item_primitives`` with the index's columns read and written by
    the Python loops (where ``kvtierd.tiers._columns`` was not built)."""
    python_columns(monkeypatch)
    test_batches_match_per_item_primitives(pair, seed)


def test_acquire_slots_holds_entries_for_chunks_it_must_verify_or_spans_runs(pair):
    """acquire_slots holds by slot only a one-run, verified chunk: an unverified one (a warm
    restart's) and one over several runs come back as acquired entries."""
    _, tier = pair
    put_batch(tier, SPACE, [b"plain", b"unverified"], [PAGE, PAGE])
    status, split = tier.reserve((SPACE, b"split"), "fp", 2 * PAGE, owner=1)
    tier.commit(split, fill(tier, [split])[0])
    tier.index.set_runs(split, [(split.runs[0][0], 1), (split.runs[0][0] + 1, 1)])
    split.runs = [(split.runs[0][0], 1), (split.runs[0][0] + 1, 1)]  # as a fragmented arena has
    tier.compact()
    slot = tier.index.slot((SPACE, b"unverified"))
    tier.index.entry(slot).verified = False
    tier.compact()
    got, held, pages = tier.acquire_slots(SPACE, [b"plain", b"unverified", b"split"],
                                          [PAGE, PAGE, 2 * PAGE], "fp")
    assert type(got[0]) is int and got[0] >= 0 and held == [tier.index.slot((SPACE, b"plain"))]
    assert not got[1].verified and got[1].ref_count == 1
    assert len(got[2].runs) == 2 and got[2].ref_count == 1
    assert pages == 1 and tier.held_pages == 4
    tier.check_invariants()
    tier.release_slots(held, pages)
    tier.release_read(got[1:])
    assert tier.held_pages == 0 and not tier.index.reads
    tier.check_invariants()


def test_a_slot_read_during_delete_keeps_its_pages_and_its_slot(pair):
    """DELETE of a chunk held by slot dooms it: its pages and its slot stay out of use (a new
    chunk never takes the slot the copy releases) until the read is released."""
    _, tier = pair
    put_batch(tier, SPACE, [b"a", b"b"], [PAGE, 2 * PAGE])
    tier.compact()  # as the daemon between requests: "a" is plain, but read by slot
    got, held, pages = tier.acquire_slots(SPACE, [b"a", b"a", b"b"], [PAGE, PAGE, 2 * PAGE], "fp")
    [slot_a, _, slot_b] = held
    assert held[0] == held[1] and tier.index.reads == {slot_a: 2, slot_b: 1}
    free_before = tier.allocator.free_pages
    assert tier.delete_many(SPACE, [b"a"], "fp") == [0]
    assert tier.delete((SPACE, b"b")) is Status.OK
    assert tier.allocator.free_pages == free_before and set(tier.index.retired) == {slot_a, slot_b}
    tier.check_invariants()
    put_batch(tier, SPACE, [b"c", b"d"], [PAGE, PAGE])  # new slots, new pages
    assert {tier.index.slot((SPACE, k)) for k in (b"c", b"d")}.isdisjoint({slot_a, slot_b})
    assert bytes(tier.arena.view[got[0]:got[0] + PAGE]) == payload_of(b"a", PAGE)
    assert bytes(tier.arena.view[got[2]:got[2] + 2 * PAGE]) == payload_of(b"b", 2 * PAGE)
    tier.check_invariants()
    tier.release_slots(held, pages)
    assert not tier.index.retired and not tier.index.reads and tier.held_pages == 0
    assert tier.allocator.free_pages == free_before + 1  # c and d took two of a's and b's three
    tier.check_invariants()


def test_a_slot_read_twice_stays_held_until_every_read_is_released(pair):
    """Two GETs of one chunk held by slot at once, one of them naming it twice: releasing a GET
    leaves the other's reads holding it (its read count and its pages)."""
    _, tier = pair
    put_batch(tier, SPACE, [b"a", b"b"], [PAGE, PAGE])
    tier.compact()
    _, first, first_pages = tier.acquire_slots(SPACE, [b"a", b"b"], [PAGE, PAGE], "fp")
    _, second, second_pages = tier.acquire_slots(SPACE, [b"a", b"a"], [PAGE, PAGE], "fp")
    slot_a, slot_b = first
    assert second == [slot_a, slot_a] and tier.index.reads == {slot_a: 3, slot_b: 1}
    tier.release_slots(first, first_pages)
    assert tier.index.reads == {slot_a: 2} and tier.held_pages == second_pages == 2
    tier.check_invariants()
    tier.release_slots(second, second_pages)
    assert not tier.index.reads and tier.held_pages == 0
    tier.check_invariants()


def test_eviction_passes_over_chunks_held_by_slot(pair):
    """A full arena evicts around a chunk held by slot, as around an acquired entry."""
    each, batch = pair
    keys = [f"old-{i}".encode() for i in range(PAGES)]
    for tier, put in ((each, put_each), (batch, put_batch)):
        assert put(tier, SPACE, keys, [PAGE] * PAGES) == [Status.OK] * PAGES
    reads = Reads(each, batch, SPACE, keys[:3], [PAGE] * 3, "fp")
    Reads(each, batch, SPACE, keys[3:], [PAGE] * (PAGES - 3), "fp").release()  # held: coldest
    new = [f"new-{i}".encode() for i in range(8)]
    assert put_each(each, SPACE, new, [PAGE] * 8) == put_batch(batch, SPACE, new, [PAGE] * 8)
    assert state(each) == state(batch)
    assert all((SPACE, k) in batch.index for k in keys[:3])
    reads.check_bytes()
    reads.release()
    assert state(each) == state(batch)


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
    [entry, other] = get_each(tier, SPACE, [b"a", b"b"], [PAGE, PAGE])
    tier.release_read([other])
    free_before = tier.allocator.free_pages
    assert tier.delete_many(SPACE, [b"a", b"b", b"a"], "fp") == [0, 0, int(Status.MISS)]
    assert entry.doomed and tier.allocator.free_pages == free_before + 1  # a's pages still held
    tier.check_invariants()
    tier.release_read([entry])
    assert tier.allocator.free_pages == PAGES and len(tier.index) == 0
    tier.check_invariants()


def test_delete_many_of_plain_chunks_repeats_and_misses(pair):
    """A batch of compact one-run chunks takes delete_many's one-pass path only when every key
    is there once; a repeat or a miss (anywhere in the batch) sends it item by item, with the
    same answers as DELETE of each key."""
    each, batch = pair
    keys = [f"k{i}".encode() for i in range(12)]
    sizes = [PAGE, 2 * PAGE, 3 * PAGE - 7] * 4
    for tier, put in ((each, put_each), (batch, put_batch)):
        assert put(tier, SPACE, keys, sizes) == [Status.OK] * 12
        tier.compact()
    found, fp = batch.index.key_space(SPACE), batch.index.fingerprint_id("fp")
    for dele in ([keys[0], keys[1], keys[0]], [keys[2], b"none", keys[3]], keys[4:6] + [b"x"]):
        assert batch.index.plain_slots(found, dele, fp) is None
        assert delete_each(each, SPACE, dele) == batch.delete_many(SPACE, dele, "fp")
        assert state(each) == state(batch)
    rest = keys[6:]
    assert batch.index.plain_slots(found, rest, fp) is not None
    assert delete_each(each, SPACE, rest) == batch.delete_many(SPACE, rest, "fp") == [0] * 6
    assert state(each) == state(batch)
    assert batch.index.key_space(SPACE) is None and batch.allocator.free_runs() == [(0, PAGES)]


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
    tier.compact()  # the rest is plain: delete_many's one-pass path deletes their rows too
    index = tier.index
    assert index.plain_slots(index.key_space(SPACE), keys[3:], index.fingerprint_id("fp"))
    assert tier.delete_many(SPACE, keys[3:], "fp") == [0, 0]
    assert not list(db.rows()) and len(tier.index) == 0
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


def test_commit_many_over_two_tenants_keeps_each_in_its_partition(request):
    """Entries of two tenants, one with a quota (its own LRU partition), committed in one
    commit_many, leave the policy as commit of each does: a quota tenant evicts only its own."""
    quota = ("uid:7", "ns", 0)
    tiers = []
    for _ in range(2):
        arena = Arena(name=f"kvtierd-test-{uuid.uuid4().hex}", nbytes=PAGES * PAGE,
                      prefault=False, lock=False)
        request.addfinalizer(lambda arena=arena: arena.close(unlink=True))
        tiers.append(CpuTier(arena, PAGE, quota_pages=lambda t: 8 if t == "uid:7" else 0))
    each, batch = tiers
    entries = {}
    for tier in tiers:
        got = [tier.reserve((space, f"{space[0]}-{i}".encode()), "fp", PAGE, owner=1)[1]
               for i in range(4) for space in (SPACE, quota)]
        entries[id(tier)] = got
    for entry, digest in zip(entries[id(each)], fill(each, entries[id(each)])):
        each.commit(entry, digest)
    batch.commit_many(entries[id(batch)], fill(batch, entries[id(batch)]))
    assert state(each) == state(batch)
    part = batch.part_of_tenant(batch.index.tenant_number("uid:7"))
    assert part >= 0 and [batch.index.entry(s).ikey[0] for s in batch.policy.victims(part)] == [
        quota] * 4


@pytest.mark.parametrize("case", ["stored", "repeat", "size", "layout", "held", "entry",
                                  "reserved", "miss"])
def test_acquire_slots_of_a_stored_batch_takes_columns_only_when_the_loop_would_agree(pair, case):
    """A GET of exactly what a PUT stored is held by slot in C loops over the columns
    (``_acquire_plain``); any batch with one key that is not such a chunk goes key by key. Both
    give what the per-item primitives give."""
    each, batch = pair
    keys = [f"g{i}".encode() for i in range(8)]
    sizes = [2 * PAGE - 5] * 8
    for tier in pair:
        put_batch(tier, SPACE, keys, sizes) if tier is batch else put_each(tier, SPACE, keys,
                                                                           sizes)
        tier.compact()
    fp = "fp"
    earlier = None
    if case == "repeat":
        keys = keys + keys[:1]
        sizes = sizes + sizes[:1]
    elif case == "size":
        sizes = sizes[:-1] + [PAGE]
    elif case == "layout":
        fp = "fp-other"
    elif case == "held":  # an earlier GET still holds one of them by slot
        earlier = Reads(each, batch, SPACE, keys[:1], sizes[:1], fp)
    elif case == "entry":  # someone holds an entry of one (until the next compact)
        for tier in pair:
            tier.index.entry(tier.index.slot((SPACE, keys[3])))
    elif case == "reserved":
        for tier in pair:
            tier.delete((SPACE, keys[2]))
        assert batch.reserve_slots(SPACE, keys[2:3], sizes[2], fp)[0]
        each.reserve((SPACE, keys[2]), fp, sizes[2], 1)
    elif case == "miss":
        keys = keys + [b"never"]
        sizes = sizes + [PAGE]
    found = batch.index.key_space(SPACE)
    plain = batch._acquire_plain(found, keys, sizes, fp) is not None
    assert plain == (case == "stored")
    if plain:  # that call held them: give them back, then acquire for real
        batch.release_slots([batch.index.slot((SPACE, k)) for k in keys],
                            sum(-(-n // PAGE) for n in sizes))
    reads = Reads(each, batch, SPACE, keys, sizes, fp)
    a, b = reads.outcomes()
    assert a == b
    reads.check_bytes()
    each.check_invariants()
    batch.check_invariants()
    reads.release()
    if earlier is not None:
        earlier.release()
    assert state(each) == state(batch)
