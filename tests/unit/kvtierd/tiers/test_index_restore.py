"""A tier's index from its snapshot equals the index from its rows (chunks, checksums, flags,
free extents, tenant pages), keeps the LRU order of the stop, and is never used once the rows
changed: the unit half of ``kvtierd.tiers.index_restore`` (the daemon half is
tests/integration/test_index_snapshot.py)."""

from __future__ import annotations

import logging
import os
import random
import sqlite3
import uuid

import pytest

from kvtierd.tiers import index_snapshot
from kvtierd.tiers.arena import Arena
from kvtierd.tiers.cpu import CpuTier
from kvtierd.tiers.index_db import SNAPSHOT_KEY, ChunkIndexDB, IndexRow
from kvtierd.tiers.nvme import INDEX_NAME, NvmeTier

PAGE = 4096
PAGES = 256
META_NVME = {"page_bytes": str(PAGE), "nvme_bytes": str(PAGES * PAGE)}


def _rows(rng: random.Random) -> list[IndexRow]:
    """Rows of three key spaces (two tenants), two fingerprints, sizes of 1-3 pages, some
    multi-run chunks and gaps between chunks."""
    spaces = [("uid:1", "ns", 0), ("uid:1", "ns", 1), ("uid:2", "other", 0)]
    rows, page = [], 0
    for n in range(60):
        count = 1 + n % 3
        if count > 1 and n % 4 == 0:  # two runs, a free page between them
            runs = [(page, 1), (page + 2, count - 1)]
            page += count + 2
        else:
            runs = [(page, count)]
            page += count + n % 2
        rows.append(IndexRow(*spaces[n % 3], rng.randbytes(rng.choice((8, 32))),
                             "fp-a" if n % 5 else "fp-b", count * PAGE - rng.randrange(PAGE),
                             rng.randbytes(16), runs))
    assert page <= PAGES
    return rows


def _state(tier) -> dict:
    """Everything a start recovers, by key (slots may differ): chunks with their fields and
    flags, the LRU order, the free extents, the tier's counts."""
    index = tier.index
    chunks = {}
    for ikey, entry in index.items():
        slot = index.slot(ikey)
        chunks[ikey] = (entry.fingerprint, entry.nbytes, entry.runs, entry.checksum,
                        entry.verified, entry.on_nvme, index.is_active(slot))
    order = [index._view(slot).ikey for slot in tier.policy.victims()]
    state = {"chunks": chunks, "order": order, "free": tier.allocator.free_runs(),
             "ready": (tier.ready_chunks, tier.ready_pages)}
    if isinstance(tier, CpuTier):
        state["tenants"] = {t: n for t, n in tier.tenant_pages.items() if n}
    return state


def _touch_some(tier, rng: random.Random) -> None:
    keys = list(tier.index)
    for ikey in rng.sample(keys, len(keys) // 2):
        tier.policy.touch(tier.index.slot(ikey), tier.part_of(tier.index.slot(ikey)))


def _nvme(directory) -> NvmeTier:
    return NvmeTier(directory, PAGES * PAGE, PAGE)


def test_nvme_snapshot_equals_rows_and_keeps_the_lru_order(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    rng = random.Random(5)
    (tmp_path / "nvme").mkdir()
    db = ChunkIndexDB(tmp_path / "nvme" / INDEX_NAME, META_NVME)
    db.insert(_rows(rng))
    db.close()
    tier = _nvme(tmp_path / "nvme")
    assert "60 chunks from rows" in caplog.text
    tier.check_invariants()
    _touch_some(tier, rng)
    at_stop = _state(tier)
    assert tier.save_snapshot()
    tier.close()
    snap = index_snapshot.path_for(tmp_path / "nvme" / INDEX_NAME)
    assert snap.stat().st_mode & 0o777 == 0o600

    caplog.clear()
    tier = _nvme(tmp_path / "nvme")
    assert "60 chunks from snapshot" in caplog.text
    tier.check_invariants()
    assert _state(tier) == at_stop
    assert not snap.exists() and not tier.db.snapshot_token  # used once, then gone
    tier.close()

    tier = _nvme(tmp_path / "nvme")  # no snapshot: the rows, the same chunks and free pages
    rows_state = _state(tier)
    tier.close()
    assert rows_state["chunks"] == at_stop["chunks"] and rows_state["free"] == at_stop["free"]
    assert rows_state["ready"] == at_stop["ready"]


@pytest.fixture
def arena(request):
    arena = Arena(name=f"kvtierd-test-restore-{uuid.uuid4().hex}", nbytes=PAGES * PAGE,
                  prefault=False, lock=False)
    request.addfinalizer(lambda: arena.close(unlink=True))
    return arena


def _cpu(arena, path, quota: bool):
    tier = CpuTier(arena, PAGE, quota_pages=lambda t: 100 if quota and t == "uid:2" else 0)
    db = ChunkIndexDB(path, {"page_bytes": str(PAGE), "cpu_bytes": str(PAGES * PAGE)},
                      synchronous="NORMAL")
    tier.attach_index(db, True)
    return tier


@pytest.mark.parametrize("quota", [False, True], ids=["one-order", "tenant-partitions"])
def test_cpu_snapshot_equals_rows_with_tenant_pages(tmp_path, arena, caplog, quota):
    caplog.set_level(logging.INFO)
    rng = random.Random(6)
    path = tmp_path / "arena.index"
    db = ChunkIndexDB(path, {"page_bytes": str(PAGE), "cpu_bytes": str(PAGES * PAGE)})
    db.insert(_rows(rng))
    db.close()
    tier = _cpu(arena, path, quota)
    tier.check_invariants()
    _touch_some(tier, rng)
    at_stop = _state(tier)
    assert tier.save_snapshot()
    tier.db.close()

    caplog.clear()
    tier = _cpu(arena, path, quota)
    assert "60 chunks from snapshot" in caplog.text
    tier.check_invariants()
    assert _state(tier) == at_stop
    # each tenant's own coldest first, as at the stop
    for part in {tier.part_of(s) for s in range(len(tier.index))} - {-1}:
        assert [tier.index._view(s).ikey for s in tier.policy.victims(part)] == [
            k for k in at_stop["order"] if tier.part_of(tier.index.slot(k)) == part]
    tier.db.close()


def test_any_write_after_the_snapshot_makes_it_stale(tmp_path, caplog):
    """An offline ``ChunkIndexDB`` write (a tool, the benchmark's row filler) clears the token:
    the next start reads the rows and sees the write."""
    caplog.set_level(logging.INFO)
    rng = random.Random(7)
    (tmp_path / "nvme").mkdir()
    path = tmp_path / "nvme" / INDEX_NAME
    db = ChunkIndexDB(path, META_NVME)
    rows = _rows(rng)
    db.insert(rows)
    db.close()
    tier = _nvme(tmp_path / "nvme")
    assert tier.save_snapshot()
    tier.close()
    db = ChunkIndexDB(path, META_NVME)
    assert db.snapshot_token
    db.delete([rows[0].ikey])
    assert not db.snapshot_token
    db.close()
    check = sqlite3.connect(path)
    assert not check.execute("SELECT v FROM meta WHERE k = ?", (SNAPSHOT_KEY,)).fetchall()
    check.close()
    caplog.clear()
    tier = _nvme(tmp_path / "nvme")
    assert "59 chunks from rows" in caplog.text and "stale" in caplog.text
    assert rows[0].ikey not in tier.index
    tier.check_invariants()
    tier.close()


def test_a_busy_tier_writes_no_snapshot(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    (tmp_path / "nvme").mkdir()
    tier = _nvme(tmp_path / "nvme")
    entry = tier.reserve((("uid:1", "ns", 0), b"w"), "fp", PAGE, os.urandom(16))
    assert entry is not None  # WRITING: its row is not there yet
    assert not tier.save_snapshot()
    assert "no snapshot at stop (1 chunks in use)" in caplog.text
    assert not index_snapshot.path_for(tmp_path / "nvme" / INDEX_NAME).exists()
    tier.abort(entry)
    tier.close()


def test_an_empty_index_round_trips_and_the_tier_then_works(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    (tmp_path / "nvme").mkdir()
    tier = _nvme(tmp_path / "nvme")
    assert tier.save_snapshot()
    tier.close()
    caplog.clear()
    tier = _nvme(tmp_path / "nvme")
    assert "0 chunks from snapshot" in caplog.text
    tier.check_invariants()
    entry = tier.reserve((("uid:1", "ns", 0), b"after"), "fp", PAGE, os.urandom(16))
    assert entry is not None and entry.runs == [(0, 1)]  # every page free
    tier.abort(entry)
    tier.close()
