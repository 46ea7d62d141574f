"""NvmeTier recovery at start: the index rebuilt from its rows (straight into the compact index),
impossible and overlapping rows dropped, a changed capacity resetting the index."""

from __future__ import annotations

import logging
import os

from helpers.nvme_tier import NVME_PAGES, PAGE, disk_rows, fill, ikey, put, read

from kvtierd.protocol import Status
from kvtierd.tiers.allocator import PageAllocator
from kvtierd.tiers.chunk import ChunkState
from kvtierd.tiers.index_db import ChunkIndexDB, IndexRow
from kvtierd.tiers.nvme import INDEX_NAME
from kvtierd.tiers.nvme_file import DATA_NAME

# -- recovery --------------------------------------------------------------------------------------

def test_recovery_rebuilds_the_index_and_frees_unnamed_pages(tiers, arena, arena_pages, nvme_dir):
    tier = tiers()
    kept = {}
    for i, nbytes in enumerate([PAGE, 3 * PAGE + 1, 2 * PAGE - 9]):
        entry, data = put(tier, arena, arena_pages, b"k%d" % i, nbytes)
        kept[entry.ikey] = (entry.runs, data)
    gone, _ = put(tier, arena, arena_pages, b"gone", 2 * PAGE)
    tier.drop(gone)
    batch = tier.take_deletions()
    tier.delete_job(batch)()
    tier.deleted(batch)
    # a write cut off before its row: data on the pages (even durable), no row
    orphan = tier.reserve(ikey(b"orphan"), "fp", 4 * PAGE, b"o" * 16)
    src = arena_pages.allocate(4)
    assert len(src) == 1
    fill(arena, src, os.urandom(4 * PAGE))
    base = src[0][0] * PAGE
    for start, count in orphan.runs:
        tier.file.write(start, [arena.view[base:base + count * PAGE]])
    tier.file.sync()
    arena_pages.free(src)
    named = sum(e.pages for e in tier.index.values() if e.state is ChunkState.READY)
    tiers.close(tier)

    tier = tiers()
    tier.check_invariants()
    assert set(tier.index) == set(kept)
    assert all(e.state is ChunkState.READY for e in tier.index.values())
    assert tier.allocator.free_pages == NVME_PAGES - named  # the orphan's pages are free again
    assert tier.used_bytes == tier.stats()["committed_bytes"] == named * PAGE
    used = [r for runs, _ in kept.values() for r in runs]
    assert tier.allocator.free_runs() == PageAllocator.from_used(NVME_PAGES, used).free_runs()
    for key, (runs, data) in kept.items():
        status, entry = tier.lookup(key, "fp")
        assert status is Status.OK and entry.runs == runs
        assert read(tier, arena, arena_pages, entry) == data
    assert tier.lookup(ikey(b"gone"), "fp")[0] is Status.MISS
    assert tier.lookup(ikey(b"orphan"), "fp")[0] is Status.MISS
    # and the recovered tier goes on working: new chunks fill the free pages
    entry, data = put(tier, arena, arena_pages, b"after", 6 * PAGE)
    assert read(tier, arena, arena_pages, entry) == data


def write_rows(directory, rows: list[IndexRow], pages: int = NVME_PAGES) -> None:
    db = ChunkIndexDB(directory / INDEX_NAME,
                      {"page_bytes": str(PAGE), "nvme_bytes": str(pages * PAGE)})
    db.insert(rows)
    db.close()


def test_recovery_drops_rows_that_name_impossible_pages(tiers, arena, arena_pages, nvme_dir,
                                                        caplog):
    tier = tiers()
    good, data = put(tier, arena, arena_pages, b"good", 2 * PAGE)
    tiers.close(tier)
    write_rows(nvme_dir, [
        IndexRow("uid:1000", "ns", 0, b"past-the-end", "fp", PAGE, b"s" * 16, [(NVME_PAGES - 1, 2)]),
        IndexRow("uid:1000", "ns", 0, b"too-few-pages", "fp", 3 * PAGE, b"s" * 16, [(10, 2)]),
        IndexRow("uid:1000", "ns", 0, b"too-many-pages", "fp", PAGE, b"s" * 16, [(20, 2)]),
    ])
    with caplog.at_level(logging.WARNING, logger="kvtierd.tiers.nvme"):
        tier = tiers()
    tier.check_invariants()
    assert set(tier.index) == {good.ikey}
    assert "impossible pages" in caplog.text
    assert set(disk_rows(nvme_dir)) == {b"good"}  # the bad rows are deleted, not kept around
    assert tier.used_bytes == 2 * PAGE
    assert read(tier, arena, arena_pages, tier.index[good.ikey]) == data


def test_recovery_drops_everything_when_rows_overlap(tiers, arena, arena_pages, nvme_dir, caplog):
    tier = tiers()
    put(tier, arena, arena_pages, b"a", 2 * PAGE)
    tiers.close(tier)
    write_rows(nvme_dir, [IndexRow("uid:1000", "ns", 0, b"b", "fp", 2 * PAGE, b"s" * 16, [(1, 2)])])
    with caplog.at_level(logging.ERROR, logger="kvtierd.tiers.nvme"):
        tier = tiers()
    tier.check_invariants()
    assert len(tier.index) == 0 and tier.used_bytes == 0
    assert "overlapping" in caplog.text
    assert disk_rows(nvme_dir) == {}


def test_recovery_drops_only_the_row_with_an_empty_run(tiers, arena, arena_pages, nvme_dir):
    tier = tiers()
    good, _ = put(tier, arena, arena_pages, b"good", 2 * PAGE)
    tiers.close(tier)
    write_rows(nvme_dir, [IndexRow("uid:1000", "ns", 0, b"empty-run", "fp", PAGE, b"s" * 16,
                                   [(20, 0), (21, 1)])])
    tier = tiers()
    tier.check_invariants()
    assert set(tier.index) == {good.ikey}


def test_changed_capacity_resets_the_index(tiers, arena, arena_pages, nvme_dir, caplog):
    tier = tiers()
    put(tier, arena, arena_pages, b"a", PAGE)
    tiers.close(tier)
    with caplog.at_level(logging.WARNING, logger="kvtierd.tiers.nvme"):
        tier = tiers(pages=NVME_PAGES * 2)
    assert tier.db.reset_reason and "nvme_bytes" in tier.db.reset_reason
    assert len(tier.index) == 0 and tier.used_bytes == 0
    assert (nvme_dir / DATA_NAME).stat().st_size == 2 * NVME_PAGES * PAGE
    assert "index reset" in caplog.text
