"""NvmeTier on a real directory (data file + SQLite index) and a real shared-memory Arena: the write
and read jobs, integrity checks, deferred page freeing, eviction, the directory lock, faults.
Recovery at start is in test_nvme_recovery.py."""

from __future__ import annotations

import errno
import json
import os

import pytest
import xxhash

from helpers.nvme_tier import NVME_PAGES, PAGE, disk_rows, fill, flip, ikey, put, read

from kvtierd.protocol import Status
from kvtierd.tiers.chunk import ChunkState, segments
from kvtierd.tiers.nvme import IntegrityError, NvmeTier
from kvtierd.tiers.nvme_file import (
    DATA_NAME,
    DirectoryInUse,
    FaultInjector,
    lock_directory,
    probe_direct_io,
)

# -- writes and reads ------------------------------------------------------------------------------

def test_reserve_write_commit_lookup_read(tiers, arena, arena_pages, nvme_dir):
    tier = tiers()
    assert tier.stats()["direct_io"] == int(tier.direct_io)
    assert (nvme_dir / DATA_NAME).stat().st_size == NVME_PAGES * PAGE  # preallocated
    data = os.urandom(3 * PAGE + 5)
    # the source is fragmented in the arena: two runs
    src = arena_pages.allocate(1) + arena_pages.allocate(2)
    gap = arena_pages.allocate(1)
    src += arena_pages.allocate(1)
    arena_pages.free(gap)
    assert len(src) == 3
    fill(arena, src, data)
    entry = tier.reserve(ikey(b"a"), "fp", len(data), xxhash.xxh3_128_digest(data))
    assert entry.pages == 4 and entry.state is ChunkState.PENDING
    assert tier.reserve(ikey(b"a"), "fp", len(data), b"x" * 16) is None  # one writer per key
    assert tier.lookup(ikey(b"a"), "fp") == (Status.MISS, None)  # WRITING is invisible
    s = tier.stats()
    assert s["pending_chunks"] == 1 and s["chunks"] == 0 and s["used_bytes"] == 4 * PAGE
    tier.check_invariants()

    assert tier.write_job([(entry, src)], arena)() == 4 * PAGE
    assert disk_rows(nvme_dir) == {b"a": entry.runs}  # durable before it is committed in memory
    tier.commit(entry)
    tier.check_invariants()
    status, found = tier.lookup(ikey(b"a"), "fp")
    assert status is Status.OK and found is entry and entry.state is ChunkState.READY
    assert tier.lookup(ikey(b"a"), "other-fp") == (Status.LAYOUT_MISMATCH, None)
    assert tier.lookup(ikey(b"b"), "fp") == (Status.MISS, None)
    s = tier.stats()
    assert s["chunks"] == 1 and s["pending_chunks"] == 0 and s["committed_bytes"] == 4 * PAGE
    assert s["writes"] == 1
    assert read(tier, arena, arena_pages, entry) == data


def test_one_write_job_for_many_chunks(tiers, arena, arena_pages, nvme_dir):
    tier = tiers()
    items, payloads = [], []
    for i, nbytes in enumerate([PAGE, 2 * PAGE - 1, 5 * PAGE + 3]):
        data = os.urandom(nbytes)
        src = arena_pages.allocate(tier.pages_for(nbytes))
        fill(arena, src, data)
        entry = tier.reserve(ikey(b"m%d" % i), "fp", nbytes, xxhash.xxh3_128_digest(data))
        items.append((entry, src))
        payloads.append(data)
    assert tier.write_job(items, arena)() == (1 + 2 + 6) * PAGE
    assert set(disk_rows(nvme_dir)) == {b"m0", b"m1", b"m2"}
    for entry, _ in items:
        tier.commit(entry)
    tier.check_invariants()
    for (entry, _), data in zip(items, payloads):
        assert read(tier, arena, arena_pages, entry) == data


def test_fragmented_file_pages_round_trip(tiers, arena, arena_pages):
    tier = tiers(pages=8)
    a, _ = put(tier, arena, arena_pages, b"a", 2 * PAGE)
    b, _ = put(tier, arena, arena_pages, b"b", 2 * PAGE)
    c, _ = put(tier, arena, arena_pages, b"c", 2 * PAGE)
    for entry in (a, c):
        tier.drop(entry)
    batch = tier.take_deletions()
    tier.delete_job(batch)()
    tier.deleted(batch)
    entry, data = put(tier, arena, arena_pages, b"big", 5 * PAGE + 1)  # 6 pages in 3 runs
    assert len(entry.runs) >= 2, entry.runs
    assert read(tier, arena, arena_pages, entry) == data
    assert tier.used_bytes == 8 * PAGE


def test_corrupt_byte_in_the_file_raises_integrity_error(tiers, arena, arena_pages, nvme_dir):
    tier = tiers()
    entry, data = put(tier, arena, arena_pages, b"c", 3 * PAGE - 100)
    assert read(tier, arena, arena_pages, entry) == data
    last_page = entry.runs[-1][0] + entry.runs[-1][1] - 1
    flip(nvme_dir, last_page, offset=PAGE - 200)  # inside the payload's last page
    dst = arena_pages.allocate(entry.pages)
    with pytest.raises(IntegrityError, match="checksum mismatch"):
        tier.read_job(entry, arena, dst, segments(dst, entry.nbytes, PAGE))()
    arena_pages.free(dst)
    tier.check_invariants()


def test_abort_frees_the_pages_and_indexes_nothing(tiers, arena, nvme_dir):
    tier = tiers()
    entry = tier.reserve(ikey(b"x"), "fp", 2 * PAGE, b"s" * 16)
    assert tier.used_bytes == 2 * PAGE
    tier.abort(entry)
    tier.check_invariants()
    assert tier.used_bytes == 0 and tier.stats()["pending_chunks"] == 0
    assert tier.lookup(ikey(b"x"), "fp") == (Status.MISS, None)
    assert tier.stats()["write_failures"] == 1
    assert disk_rows(nvme_dir) == {}


# -- leaving: rows first, pages after --------------------------------------------------------------

def test_drop_frees_pages_only_after_the_row_is_deleted(tiers, arena, arena_pages, nvme_dir):
    tier = tiers()
    dropped = []
    tier.on_drop = dropped.append
    entry, _ = put(tier, arena, arena_pages, b"d", 3 * PAGE)
    keep, keep_data = put(tier, arena, arena_pages, b"keep", PAGE)
    assert tier.take_deletions() is None
    tier.drop(entry)
    tier.check_invariants()
    assert dropped == [entry]
    assert tier.lookup(ikey(b"d"), "fp") == (Status.MISS, None)
    assert tier.stats()["chunks"] == 1
    assert tier.used_bytes == 4 * PAGE and tier.pending_free_pages == 3  # not free yet
    assert b"d" in disk_rows(nvme_dir)
    batch = tier.take_deletions()
    assert batch == [entry] and tier.take_deletions() is None
    tier.delete_job(batch)()
    assert set(disk_rows(nvme_dir)) == {b"keep"}
    assert tier.used_bytes == 4 * PAGE  # the row is gone, the pages come back only now:
    tier.deleted(batch)
    tier.check_invariants()
    assert tier.used_bytes == PAGE and tier.pending_free_pages == 0
    assert tier.stats()["used_bytes"] == tier.stats()["committed_bytes"] == PAGE
    assert read(tier, arena, arena_pages, keep) == keep_data


def test_drop_while_being_read_waits_for_the_reader(tiers, arena, arena_pages):
    tier = tiers()
    entry, data = put(tier, arena, arena_pages, b"r", 2 * PAGE)
    tier.acquire(entry)  # a promotion is reading it
    tier.drop(entry)
    tier.check_invariants()
    assert entry.doomed and tier.take_deletions() is None
    assert read(tier, arena, arena_pages, entry) == data  # the reader still gets its bytes
    tier.release(entry)
    batch = tier.take_deletions()
    assert batch == [entry]
    tier.delete_job(batch)()
    tier.deleted(batch)
    tier.check_invariants()
    assert tier.used_bytes == 0


def test_delete_of_a_chunk_being_written_is_busy(tiers, arena, arena_pages):
    tier = tiers()
    entry = tier.reserve(ikey(b"w"), "fp", PAGE, b"s" * 16)
    assert tier.delete(ikey(b"w")) is Status.BUSY
    assert tier.delete(ikey(b"nope")) is Status.MISS
    tier.abort(entry)
    done, _ = put(tier, arena, arena_pages, b"w", PAGE)
    assert tier.delete(ikey(b"w")) is Status.OK
    tier.check_invariants()
    assert tier.lookup(ikey(b"w"), "fp") == (Status.MISS, None)


def test_evict_takes_the_least_recently_used_and_skips_busy_chunks(tiers, arena, arena_pages):
    tier = tiers(pages=8)
    entries = {k: put(tier, arena, arena_pages, k, 2 * PAGE)[0] for k in (b"0", b"1", b"2", b"3")}
    assert tier.allocator.free_pages == 0
    tier.lookup(ikey(b"0"), "fp")  # touched: now the most recent
    tier.acquire(entries[b"1"])  # being read: not a victim
    assert tier.evict(3) == 4  # whole chunks: 2 victims
    tier.check_invariants()
    assert tier.lookup(ikey(b"2"), "fp")[0] is Status.MISS
    assert tier.lookup(ikey(b"3"), "fp")[0] is Status.MISS
    assert tier.lookup(ikey(b"0"), "fp")[0] is Status.OK
    assert tier.lookup(ikey(b"1"), "fp")[0] is Status.OK
    assert tier.stats()["evictions"] == 2
    tier.release(entries[b"1"])
    batch = tier.take_deletions()
    tier.delete_job(batch)()
    tier.deleted(batch)
    assert tier.allocator.free_pages == 4
    tier.check_invariants()


def test_reserve_on_a_full_tier_evicts_and_succeeds(tiers, arena, arena_pages):
    tier = tiers(pages=8)
    for k in (b"0", b"1", b"2", b"3"):
        put(tier, arena, arena_pages, k, 2 * PAGE)
    entry = tier.reserve(ikey(b"new"), "fp", 2 * PAGE, b"s" * 16)
    tier.check_invariants()
    assert entry is not None, f"reserve on a full tier failed: {dict(tier.counters)}"
    assert tier.lookup(ikey(b"0"), "fp")[0] is Status.MISS  # the LRU chunk made room


# -- the directory lock ----------------------------------------------------------------------------

def test_one_tier_per_directory(tiers, nvme_dir):
    tier = tiers()
    with pytest.raises(DirectoryInUse, match="in use"):
        NvmeTier(nvme_dir, NVME_PAGES * PAGE, PAGE)
    with pytest.raises(DirectoryInUse, match=str(nvme_dir)):
        lock_directory(nvme_dir)
    tiers.close(tier)
    os.close(lock_directory(nvme_dir))  # free again once closed
    tiers()


# -- faults ----------------------------------------------------------------------------------------

def set_faults(path, faults) -> None:
    path.write_text(json.dumps(faults))


def raised(job) -> OSError:
    """Run a job that must fail; return its error without its traceback (whose frames would keep
    views of the arena alive)."""
    try:
        job()
    except OSError as exc:
        exc.__traceback__ = None
        return exc
    raise AssertionError("the job did not fail")


def test_fault_injector_raises_the_named_errno(tiers, arena, arena_pages, nvme_dir, tmp_path):
    faults = tmp_path / "faults.json"  # absent: no fault
    tier = tiers(fault_file=faults)
    assert isinstance(tier.file, FaultInjector)
    entry, data = put(tier, arena, arena_pages, b"ok", 2 * PAGE)

    set_faults(faults, {"write": "ENOSPC"})
    src = arena_pages.allocate(1)
    fill(arena, src, os.urandom(PAGE))
    failed = tier.reserve(ikey(b"enospc"), "fp", PAGE, b"s" * 16)
    exc = raised(tier.write_job([(failed, src)], arena))
    assert exc.errno == errno.ENOSPC and "injected ENOSPC" in str(exc)
    assert set(disk_rows(nvme_dir)) == {b"ok"}  # nothing indexed
    tier.abort(failed)
    tier.check_invariants()
    assert read(tier, arena, arena_pages, entry) == data  # reads are not affected

    set_faults(faults, {"sync": "EIO"})
    failed = tier.reserve(ikey(b"sync"), "fp", PAGE, b"s" * 16)
    assert raised(tier.write_job([(failed, src)], arena)).errno == errno.EIO
    assert set(disk_rows(nvme_dir)) == {b"ok"}  # the data went out but was never made durable
    tier.abort(failed)

    set_faults(faults, {"read": "EIO", "write": ""})
    dst = arena_pages.allocate(entry.pages)
    job = tier.read_job(entry, arena, dst, segments(dst, entry.nbytes, PAGE))
    assert raised(job).errno == errno.EIO
    del job
    arena_pages.free(dst)

    set_faults(faults, {"write": "ENOENT"})  # the directory vanished
    failed = tier.reserve(ikey(b"gone"), "fp", PAGE, b"s" * 16)
    assert raised(tier.write_job([(failed, src)], arena)).errno == errno.ENOENT
    tier.abort(failed)

    faults.write_text("not json")  # unreadable: no fault
    again, again_data = put(tier, arena, arena_pages, b"again", PAGE)
    faults.unlink()
    assert read(tier, arena, arena_pages, again) == again_data
    arena_pages.free(src)
    assert tier.stats()["write_failures"] == 3
    tier.check_invariants()


def test_direct_io_probe_matches_the_tier(tiers, nvme_dir):
    tier = tiers()
    assert tier.direct_io == probe_direct_io(nvme_dir, PAGE)
    assert tier.file.direct == tier.direct_io
    assert not (nvme_dir / ".direct-io-probe").exists()
