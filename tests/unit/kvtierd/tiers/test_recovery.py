"""load_rows: a tier's index rebuilt from its stored rows in batches (real SQLite files): row order
kept across key spaces and tenants, bad rows (impossible runs, ids naming nothing) dropped by their
stored key, overlapping rows refused."""

from __future__ import annotations

import random
import sqlite3

import pytest
from helpers.index_schema3 import write_schema_3

from kvtierd.eviction.lru import LRUPolicy
from kvtierd.tiers import index_format
from kvtierd.tiers.allocator import PageAllocator
from kvtierd.tiers.compact_index import ChunkIndex
from kvtierd.tiers.index_db import ChunkIndexDB, IndexRow
from kvtierd.tiers.recovery import load_rows

PAGE = 4096
PAGES = 256
META = {"page_bytes": str(PAGE)}
SPACES = [("uid:1000", "ns", 0), ("uid:1000", "ns", 1), ("uid:2000", "other", 0)]


def load(db: ChunkIndexDB, parts: dict[str, int] | None = None):
    index, policy = ChunkIndex(PAGE), LRUPolicy(slack=4)
    parts = parts or {}

    def part_of(slot: int) -> int:
        return parts.get(index.tenant_name(index.tenant_id(slot)), -1)

    return index, policy, load_rows(db, index, policy, part_of, PAGES, verified=False)


def written(rng: random.Random, count: int) -> list[IndexRow]:
    """Rows of every space interleaved (as TP ranks write them), one to three pages each, on
    distinct pages in shuffled order."""
    rows, page = [], 0
    for i in range(count):
        pages = 1 + i % 3
        tenant, ns, rank = SPACES[i % len(SPACES)]
        rows.append(IndexRow(tenant, ns, rank, rng.randbytes(32), f"fp{i % 2}",
                             pages * PAGE - rng.randrange(PAGE), rng.randbytes(16),
                             [(page, pages)]))
        page += pages
    return rows


def test_rows_of_mixed_spaces_and_tenants_come_back_in_row_order(tmp_path):
    rng = random.Random(12)
    db = ChunkIndexDB(tmp_path / "index", META)
    rows = written(rng, 60)
    for r in rows:  # one transaction per row, as commits write them
        db.insert([r])
    index, policy, loaded = load(db)
    index.check_invariants()
    policy.check_invariants()
    assert loaded.bad == [] and loaded.pages == sum(c for r in rows for _, c in r.runs)
    assert dict(loaded.tenant_pages) == {t: sum(c for r in rows if r.tenant == t for _, c in r.runs)
                                         for t in ("uid:1000", "uid:2000")}
    order = [index.entry(slot).ikey for slot in policy.victims()]
    assert order == [r.ikey for r in rows]  # the LRU order is the order rows were written
    for r in rows:
        e = index[r.ikey]
        assert (e.fingerprint, e.nbytes, e.checksum, e.runs, e.verified) == (
            r.fingerprint, r.nbytes, r.checksum, r.runs, False)
    used = [run for r in rows for run in r.runs]
    assert loaded.allocator.free_runs() == PageAllocator.from_used(PAGES, used).free_runs()
    db.close()


def test_tenants_with_a_partition_keep_their_own_order(tmp_path):
    rng = random.Random(13)
    db = ChunkIndexDB(tmp_path / "index", META)
    rows = written(rng, 30)
    db.insert(rows)
    index, policy, _ = load(db, parts={"uid:2000": 7})
    mine = [index.entry(slot).ikey for slot in policy.victims(7)]
    assert mine == [r.ikey for r in rows if r.tenant == "uid:2000"]
    db.close()


def test_rows_naming_no_space_or_impossible_pages_are_dropped_by_stored_key(tmp_path):
    rng = random.Random(14)
    db = ChunkIndexDB(tmp_path / "index", META)
    good = written(rng, 6)
    db.insert(good)
    db.insert([IndexRow("uid:1000", "ns", 0, b"past-the-end", "fp0", PAGE, rng.randbytes(16),
                        [(PAGES - 1, 2)]),
               IndexRow("uid:1000", "ns", 0, b"negative-size", "fp0", -5, rng.randbytes(16),
                        [(200, 1)])])
    with db.lock:  # a row whose space id names no space (a hand-edited or damaged file)
        db._db.execute("INSERT INTO entries VALUES (999, x'0102', ?)", (index_format.pack(
            1, 10, rng.randbytes(16), bytes(16) + (1).to_bytes(8, "little")),))
    index, _, loaded = load(db)
    index.check_invariants()
    assert set(index) == {r.ikey for r in good}
    sid = db.space_names()
    assert sorted(loaded.bad, key=repr) == sorted(
        [(next(i for i, s in sid.items() if s == ("uid:1000", "ns", 0)), b"past-the-end"),
         (next(i for i, s in sid.items() if s == ("uid:1000", "ns", 0)), b"negative-size"),
         (999, b"\x01\x02")], key=repr)
    db.delete_stored(loaded.bad)
    assert db.count() == len(good)
    db.close()


@pytest.mark.parametrize("single_pages", [False, True])
def test_overlapping_rows_in_one_batch_are_refused(tmp_path, single_pages):
    rng = random.Random(15)
    db = ChunkIndexDB(tmp_path / "index", META)
    rows = written(rng, 9)
    if single_pages:  # the batch's one-page path
        rows = [IndexRow(r.tenant, r.namespace, r.rank, r.key, r.fingerprint, PAGE, r.checksum,
                         [(i, 1)]) for i, r in enumerate(rows)]
    twin = rows[4]
    db.insert(rows + [IndexRow("uid:2000", "other", 0, b"twin", "fp0", PAGE, rng.randbytes(16),
                               [(twin.runs[0][0] + twin.runs[0][1] - 1, 1)])])
    _, _, loaded = load(db)
    assert loaded.allocator is None and loaded.overlap
    db.close()


def test_a_migrated_schema_3_index_loads_as_written_and_drops_the_rows_it_dropped(tmp_path):
    """Rows the schema-3 recovery dropped (a negative size, runs that are not whole pairs, a
    checksum an operator's hand edit made text) are carried over as they were and dropped by
    stored key; every other chunk comes back with every field, in the order written."""
    rng = random.Random(16)
    path = tmp_path / "index"
    rows = written(rng, 40)
    negative = IndexRow("uid:1000", "ns", 0, b"negative-size", "fp0", -5, rng.randbytes(16),
                        [(240, 1)])
    write_schema_3(path, rows + [negative], META)
    conn = sqlite3.connect(path)
    conn.execute("INSERT INTO entries SELECT space, x'0badd1', fingerprint, nbytes, checksum,"
                 " x'0102' FROM entries LIMIT 1")  # runs: two bytes, not a (start, count) pair
    conn.execute("INSERT INTO entries SELECT space, x'7e47', fingerprint, nbytes, 'text', runs"
                 " FROM entries WHERE rowid = 2")
    conn.commit()
    conn.close()
    db = ChunkIndexDB(path, META)
    assert db.reset_reason == ""
    index, policy, loaded = load(db)
    index.check_invariants()
    sid = next(i for i, s in db.space_names().items() if s == ("uid:1000", "ns", 0))
    assert sorted(k for _, k in loaded.bad) == sorted([b"negative-size", b"\x0b\xad\xd1", b"~G"])
    assert all(s in db.space_names() for s, _ in loaded.bad) and (sid, b"negative-size") in (
        loaded.bad)
    assert [index.entry(slot).ikey for slot in policy.victims()] == [r.ikey for r in rows]
    for r in rows:
        e = index[r.ikey]
        assert (e.fingerprint, e.nbytes, e.checksum, e.runs) == (
            r.fingerprint, r.nbytes, r.checksum, r.runs)
    db.delete_stored(loaded.bad)
    assert db.count() == len(rows)
    db.close()
