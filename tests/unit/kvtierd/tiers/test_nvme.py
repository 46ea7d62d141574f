"""NvmeTier on a real directory (data file + SQLite index) and a real shared-memory Arena: the write
and read jobs, integrity checks, deferred page freeing, recovery, the directory lock, faults."""

from __future__ import annotations

import errno
import json
import logging
import os
import sqlite3
import uuid

import pytest
import xxhash

from kvtierd.protocol import Status
from kvtierd.tiers.allocator import PageAllocator
from kvtierd.tiers.arena import Arena
from kvtierd.tiers.chunk import ChunkState, segments
from kvtierd.tiers.index_db import ChunkIndexDB, IndexRow, unpack_runs
from kvtierd.tiers.nvme import INDEX_NAME, IntegrityError, NvmeTier
from kvtierd.tiers.nvme_file import (
    DATA_NAME,
    DirectoryInUse,
    FaultInjector,
    lock_directory,
    probe_direct_io,
)

PAGE = 4096
NVME_PAGES = 32
ARENA_PAGES = 64
SPACE = ("uid:1000", "ns", 0)  # (tenant, namespace, rank)
POISON = 0xAB


@pytest.fixture
def arena(request):
    arena = Arena(name=f"kvtierd-test-nvme-{uuid.uuid4().hex}", nbytes=ARENA_PAGES * PAGE,
                  prefault=False, lock=False)
    request.addfinalizer(lambda: arena.close(unlink=True))
    return arena


@pytest.fixture
def arena_pages():
    return PageAllocator(ARENA_PAGES)


@pytest.fixture
def nvme_dir(tmp_path):
    return tmp_path / "nvme"


class Tiers:
    """Opens tiers on one directory and closes whatever is still open at the end."""

    def __init__(self, directory):
        self.directory = directory
        self.open: list[NvmeTier] = []

    def __call__(self, pages: int = NVME_PAGES, **kwargs) -> NvmeTier:
        tier = NvmeTier(self.directory, pages * PAGE, PAGE, **kwargs)
        self.open.append(tier)
        return tier

    def close(self, tier: NvmeTier) -> None:
        tier.check_invariants()
        tier.close()
        self.open.remove(tier)


@pytest.fixture
def tiers(nvme_dir):
    t = Tiers(nvme_dir)
    yield t
    for tier in list(t.open):
        t.close(tier)


def ikey(key: bytes):
    return (SPACE, key)


def fill(arena: Arena, runs, data: bytes) -> None:
    pos = 0
    for offset, length in segments(runs, len(data), PAGE):
        arena.view[offset:offset + length] = data[pos:pos + length]
        pos += length


def read_arena(arena: Arena, runs, nbytes: int) -> bytes:
    return b"".join(bytes(arena.view[o:o + n]) for o, n in segments(runs, nbytes, PAGE))


def poison(arena: Arena, runs) -> None:
    for start, count in runs:
        arena.view[start * PAGE:(start + count) * PAGE] = bytes([POISON]) * (count * PAGE)


def put(tier: NvmeTier, arena: Arena, arena_pages: PageAllocator, key: bytes, nbytes: int):
    """Reserve, write (data, fdatasync, row) and commit one chunk; returns (entry, payload)."""
    data = os.urandom(nbytes)
    src = arena_pages.allocate(tier.pages_for(nbytes))
    fill(arena, src, data)
    entry = tier.reserve(ikey(key), "fp", nbytes, xxhash.xxh3_128_digest(data))
    assert entry is not None
    assert tier.write_job([(entry, src)], arena)() == entry.pages * PAGE
    tier.commit(entry)
    arena_pages.free(src)
    tier.check_invariants()
    return entry, data


def read(tier: NvmeTier, arena: Arena, arena_pages: PageAllocator, entry) -> bytes:
    dst = arena_pages.allocate(entry.pages)
    try:
        poison(arena, dst)
        assert tier.read_job(entry, arena, dst, segments(dst, entry.nbytes, PAGE))() == \
            entry.nbytes
        return read_arena(arena, dst, entry.nbytes)
    finally:
        arena_pages.free(dst)


def disk_rows(directory) -> dict:
    db = sqlite3.connect(f"file:{directory / INDEX_NAME}?mode=ro", uri=True)
    try:
        return {bytes(k): unpack_runs(r) for k, r in db.execute("SELECT key, runs FROM chunks")}
    finally:
        db.close()


def flip(directory, page: int, offset: int = 0) -> None:
    fd = os.open(directory / DATA_NAME, os.O_RDWR)
    try:
        pos = page * PAGE + offset
        os.pwrite(fd, bytes([os.pread(fd, 1, pos)[0] ^ 0x01]), pos)
        os.fsync(fd)
    finally:
        os.close(fd)


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
