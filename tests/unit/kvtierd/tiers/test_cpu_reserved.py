"""The CPU tier's PUT reservations held by slot (kvtierd.tiers.cpu_reserved) against the per-item
reserve / commit / abort they replace, over two tiers on real arenas (helpers.cpu_pair), with the
requests a daemon may serve while the copies are in flight."""

import random

import pytest
import xxhash

from helpers.cpu_pair import (OTHER, PAGE, PAGES, SPACE, Reads, delete_each, fill, payload_of,
                              put_each, python_columns, state)
from kvtierd.protocol import Status
from kvtierd.tiers.chunk import ChunkState


def reserve_by_slot(tier, space, keys, nbytes, fp="fp"):
    """What the PUT fast path does: the placed prefix by slot, the rest as entries. Returns the
    per-item statuses and the two kinds of reservation."""
    slots, offsets = tier.reserve_slots(space, keys, nbytes, fp)
    assert offsets == [tier.index.start_column[s] * PAGE for s in slots]
    rest = tier.reserve_many(space, keys[len(slots):], [nbytes] * (len(keys) - len(slots)), fp,
                             owner=1)
    statuses = [Status.OK] * len(slots) + [s for s, _ in rest]
    return statuses, slots, [e for _, e in rest if e is not None]


def fill_slots(tier, space, slots, keys, nbytes):
    digests = []
    for slot, key in zip(slots, keys):
        data = payload_of(key, nbytes)
        at = tier.index.start_column[slot] * PAGE
        tier.arena.view[at:at + nbytes] = data
        digests.append(xxhash.xxh3_128_digest(data))
    return digests


def meddle(rng, each, batch, space, keys, nbytes, fp):
    """What other requests may do to keys while their PUT's copies are in flight: both tiers
    must answer alike (a reservation is PENDING, whether an entry or held by slot)."""
    key = rng.choice(keys)
    op = rng.choice(["lookup", "lookup_slots", "acquire", "delete", "delete_many", "reput",
                     "entry", "invariants"])
    if op == "lookup":
        assert each.lookup((space, key), fp)[0] == batch.lookup((space, key), fp)[0]
    elif op == "lookup_slots":
        picked = rng.sample(keys, rng.randint(1, len(keys)))
        a, b = (["hit" if s >= 0 else s for s in t.lookup_slots(space, picked, fp)]
                for t in (each, batch))
        assert a == b
    elif op == "acquire":
        reads = Reads(each, batch, space, [key], [nbytes], fp)
        a, b = reads.outcomes()
        assert a == b
        reads.release()
    elif op == "delete":
        assert each.delete((space, key)) == batch.delete((space, key))
    elif op == "delete_many":
        assert delete_each(each, space, [key], fp) == batch.delete_many(space, [key], fp)
    elif op == "reput":
        assert each.reserve((space, key), fp, nbytes, 2)[0] == batch.reserve_many(
            space, [key], [nbytes], fp, 2)[0][0]
    elif op == "entry":  # someone builds its entry: the reservation becomes that PENDING entry
        slot = batch.index.slot((space, key))
        entry = batch.index.entry(slot)
        assert entry.state is ChunkState.PENDING and slot not in batch.index.reserved
    each.check_invariants()
    batch.check_invariants()


@pytest.mark.parametrize("seed", range(12))
def test_reservations_held_by_slot_match_per_item_reserve(pair, seed):
    """Random PUT batches reserved by slot in one tier and item by item in the other, with
    lookups, reads, deletes and re-PUTs of their keys while the copies are in flight, then
    committed or aborted (a failed copy, an ended session): the same statuses, pages, eviction
    order and counters in both, and check_invariants() at every step."""
    rng = random.Random(seed)
    each, batch = pair
    by_slot = 0
    for step in range(50):
        space = SPACE if rng.random() < 0.8 else OTHER
        fp = "fp" if rng.random() < 0.9 else "fp-other"
        nbytes = rng.choice([PAGE, 2 * PAGE, 3 * PAGE - 7, 100])
        n = rng.randint(1, 10)
        if rng.random() < 0.7:
            keys = [f"s{step}-{i}".encode() for i in range(n)]  # new and distinct
        else:
            keys = [f"k-{rng.randrange(12)}".encode() for _ in range(n)]
        if rng.random() < 0.3:  # make an earlier chunk or two busy readers' or gone
            old = [f"k-{rng.randrange(12)}".encode()]
            assert delete_each(each, space, old, fp) == batch.delete_many(space, old, fp)
        mine = [each.reserve((space, k), fp, nbytes, 1) for k in keys]
        statuses, slots, entries = reserve_by_slot(batch, space, keys, nbytes, fp)
        assert [s for s, _ in mine] == statuses
        by_slot += len(slots)
        assert state(each) == state(batch), f"step {step}: reserved"
        held = [k for k, (s, _) in zip(keys, mine) if s is Status.OK]
        for _ in range(rng.randint(0, 3)):
            if held:
                meddle(rng, each, batch, space, held, nbytes, fp)
        ok = rng.random() < 0.85
        for _, entry in mine:
            if entry is not None:
                if ok:
                    each.commit(entry, fill(each, [entry])[0])
                else:
                    each.abort(entry)
        slot_keys = keys[:len(slots)]
        if ok:
            batch.commit_slots(space, fp, slot_keys, slots,
                               fill_slots(batch, space, slots, slot_keys, nbytes), nbytes)
            batch.commit_many(entries, fill(batch, entries), fold=True)
        else:
            batch.abort_slots(slots)
            for entry in entries:
                batch.abort(entry)
        assert not batch.index.reserved
        assert state(each) == state(batch), f"step {step}: {'committed' if ok else 'aborted'}"
    assert by_slot, "no reservation was held by slot"


@pytest.mark.parametrize("seed", range(3))
def test_the_same_with_the_index_columns_written_by_the_python_loops(pair, seed, monkeypatch):
    """``test_reservations_held_by_slot_match_per_item_reserve`` with the index's columns read
    and written by the Python loops (where ``kvtierd.tiers._columns`` was not built)."""
    python_columns(monkeypatch)
    test_reservations_held_by_slot_match_per_item_reserve(pair, seed)


def test_reserve_slots_places_a_prefix_and_leaves_the_rest_to_reserve_many(pair):
    """A full arena: reserve_slots takes the free runs for the first items only (never evicts);
    reserve_many then evicts for the rest as reserve would."""
    each, batch = pair
    for tier in pair:
        put_each(tier, SPACE, [f"old{i}".encode() for i in range(PAGES - 3)], [PAGE] * (PAGES - 3))
    keys = [f"new{i}".encode() for i in range(6)]
    mine = [each.reserve((SPACE, k), "fp", PAGE, 1) for k in keys]
    statuses, slots, entries = reserve_by_slot(batch, SPACE, keys, PAGE)
    assert len(slots) == 3 and len(entries) == 3
    assert [s for s, _ in mine] == statuses == [Status.OK] * 6
    assert state(each) == state(batch)
    assert batch.reserve_slots(SPACE, [b"new0"], PAGE, "fp") == ([], [])  # indexed: not by slot
    assert batch.reserve_slots(SPACE, [b"x", b"x"], PAGE, "fp") == ([], [])  # repeated


def test_commit_slots_writes_the_index_rows_before_ready(pair, tmp_path):
    from kvtierd.tiers.index_db import ChunkIndexDB

    _, tier = pair
    db = ChunkIndexDB(tmp_path / "index.sqlite", {"page_bytes": str(PAGE)})
    tier.attach_index(db, attached=False)
    keys = [f"k{i}".encode() for i in range(5)]
    slots, _ = tier.reserve_slots(SPACE, keys, 2 * PAGE - 1, "fp")
    assert not list(db.rows())  # a reservation has no row
    digests = fill_slots(tier, SPACE, slots, keys, 2 * PAGE - 1)
    tier.commit_slots(SPACE, "fp", keys, slots, digests, 2 * PAGE - 1)
    rows = {row.key: row for row in db.rows()}
    assert sorted(rows) == sorted(keys)
    for key, slot, digest in zip(keys, slots, digests):
        assert rows[key].checksum == digest and rows[key].nbytes == 2 * PAGE - 1
        assert rows[key].runs == [(tier.index.start_column[slot], 2)]
        entry = tier.index.get((SPACE, key))
        assert entry.state is ChunkState.READY and entry.checksum == digest and entry.verified
    tier.check_invariants()
    db.close()


def test_reservations_are_read_from_the_flags_as_a_set_of_slots(pair):
    """``index.reserved`` (the RESERVED flag and its count): membership, size, iteration and the
    batch checks follow reservation, an entry built for one, commit and abort."""
    _, tier = pair
    index = tier.index
    keys = [f"r-{i}".encode() for i in range(6)]
    slots, _ = tier.reserve_slots(SPACE, keys, PAGE, "fp")
    assert len(slots) == 6 and sorted(index.reserved) == sorted(slots) and len(index.reserved) == 6
    assert all(slot in index.reserved for slot in slots) and -1 not in index.reserved
    assert index.reserved.issuperset(slots) and not index.reserved.isdisjoint(slots[:1])
    entry = index.entry(slots[0])  # someone asks for one: it is that PENDING entry's now
    assert entry.state is ChunkState.PENDING and slots[0] not in index.reserved
    assert len(index.reserved) == 5 and not index.reserved.issuperset(slots)
    tier.check_invariants()
    tier.commit_slots(SPACE, "fp", keys[:4], slots[:4], fill_slots(tier, SPACE, slots[:4],
                                                                    keys[:4], PAGE), PAGE)
    assert sorted(index.reserved) == sorted(slots[4:]) and len(index.reserved) == 2
    assert index.reserved.isdisjoint(slots[:4])
    tier.abort_slots(slots[4:])
    assert not index.reserved and len(index.reserved) == 0 and list(index.reserved) == []
    assert index.reserved.isdisjoint(slots) and not index.reserved.issuperset(slots[1:4])
    tier.check_invariants()
