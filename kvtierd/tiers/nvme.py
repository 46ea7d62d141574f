"""The NVMe tier: chunks in a preallocated file, indexed in SQLite, moved by I/O threads.

Bookkeeping (this class) runs on the daemon's loop thread; the byte-moving ``*_job`` callables it
returns run on I/O threads and touch only the data file, the arena pages they were given and the
index database (which serialises itself).

Lifecycle of a chunk here: ``reserve`` (WRITING: pages allocated, invisible) → the write job writes
the pages, ``fdatasync``s them and only then inserts the index row → ``commit`` (READY) | ``abort``.
Leaving (LRU eviction, DELETE, integrity failure) removes the chunk from the in-memory index at
once; its pages return to the allocator only after the delete job committed the row's removal, so
no page is rewritten while a durable row still names it.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Callable, Hashable

from kvtierd.copy import memcpy
from kvtierd.eviction import make_policy
from kvtierd.protocol import Status
from kvtierd.tiers.allocator import PageAllocator, Run
from kvtierd.tiers.arena import Arena
from kvtierd.tiers.base import TierIndex
from kvtierd.tiers.chunk import ChunkEntry, ChunkState
from kvtierd.tiers.compact_index import ChunkIndex
from kvtierd.tiers import index_restore
from kvtierd.tiers.index_db import ChunkIndexDB, IndexRow
from kvtierd.tiers.nvme_commit import GroupCommit
from kvtierd.tiers.nvme_file import (
    DataFile,
    FaultInjector,
    IoQueue,
    claim_directory,
    lock_directory,
    make_state_dir,
    probe_direct_io,
)

log = logging.getLogger(__name__)

INDEX_NAME = "index.sqlite"
RECOVERY_LOG_EVERY = 10000
#: Largest single read or write: a chunk's runs are cut into pieces of this size that go to the
#: device at once (IoQueue), so one big chunk keeps several requests in flight, not one. It also
#: keeps every preadv/pwritev below IOV_MAX (1024) views: at most 512 pages of 4 KiB.
IO_PIECE_BYTES = 2 * 1024**2


class IntegrityError(Exception):
    """Bytes read back do not match the checksum recorded when the chunk was committed."""


class NvmeTier(TierIndex):
    name = "nvme"

    def __init__(
        self,
        directory: Path,
        nbytes: int,
        page_bytes: int,
        *,
        policy: str = "lru",
        fault_file: Path | None = None,
        on_status: Callable[[str], None] | None = None,
        instance: str = "",
        dir_mode: int = 0o700,
        queue_depth: int = 8,
    ) -> None:
        """``instance``: the owning daemon's instance id; another instance's directory is refused
        (claim_directory) instead of reset. Empty: no ownership check (tests, tools).
        ``dir_mode``: the directory's mode (state_dir_mode). ``queue_depth``: reads and writes
        in flight on the data file at most (io_queue_depth)."""
        make_state_dir(directory, dir_mode)
        self.directory = directory
        self.page_bytes = page_bytes
        self._lock_fd = lock_directory(directory)
        if instance:
            try:
                claim_directory(directory, instance)
            except BaseException:
                os.close(self._lock_fd)
                raise
        self.direct_io = probe_direct_io(directory, page_bytes)
        if not self.direct_io:
            log.warning("O_DIRECT is refused in %s; using buffered I/O with fdatasync", directory)
        data = DataFile(directory, nbytes, page_bytes, self.direct_io)
        self.file: DataFile | FaultInjector = (
            FaultInjector(data, fault_file) if fault_file is not None else data
        )
        self.num_pages = data.num_pages
        self.io = IoQueue(queue_depth)
        self._piece_pages = max(1, IO_PIECE_BYTES // page_bytes)
        self.capacity_bytes = self.num_pages * page_bytes
        self.db = ChunkIndexDB(
            directory / INDEX_NAME,
            {"page_bytes": str(page_bytes), "nvme_bytes": str(self.capacity_bytes)},
        )
        if self.db.reset_reason:
            log.warning("NVMe index reset, its chunks are dropped (%s)", self.db.reset_reason)
        self._rows: GroupCommit[IndexRow] = GroupCommit(self.db.insert)  # write jobs' rows
        self.policy_name = policy
        self.policy = make_policy(policy)
        self.index = ChunkIndex(page_bytes)
        self.counters: Counter[str] = Counter(evictions_deferred=0)
        self.pending_free_pages = 0
        self._doomed: set[ChunkEntry] = set()
        self._to_free: list[ChunkEntry] = []  # left the index; rows to delete, then pages to free
        self.on_drop: Callable[[ChunkEntry], None] = lambda entry: None
        self.on_evict: Callable[[ChunkEntry], bool] = lambda entry: True
        self.ready_chunks = self.ready_pages = 0
        self._recover(on_status or (lambda _: None))

    # -- start-up ----------------------------------------------------------------------------------
    def _recover(self, status: Callable[[str], None]) -> None:
        """Index every row straight into the compact index (no object per chunk)."""
        started = time.monotonic()
        total = self.db.rows_written()  # COUNT(*) would scan the whole index first

        def progress(n: int) -> None:
            msg = f"recovering NVMe index: {n} of at most {total} chunks"
            log.info("%s", msg)
            status(msg)

        loaded, source = index_restore.restore(self, self.db, verified=True,
                                               reset=self._fresh_index, progress=progress)
        if loaded.allocator is None:  # overlapping rows: the index cannot be trusted
            log.error("NVMe index names overlapping pages (%s); dropping all its chunks",
                      loaded.overlap)
            self.db.clear()
            self._fresh_index()
            self.allocator = PageAllocator(self.num_pages)
        else:
            self.allocator = loaded.allocator
            self.ready_chunks = len(self.index)
            self.ready_pages = loaded.pages
            if loaded.bad:
                self.db.delete_stored(loaded.bad)
                log.warning("dropped %d NVMe index rows that named impossible pages",
                            len(loaded.bad))
        log.info("NVMe tier %s: %d chunks recovered from %s in %.2f s (O_DIRECT=%s)",
                 self.directory, len(self.index), source, time.monotonic() - started,
                 self.direct_io)

    def _fresh_index(self) -> None:
        self.index = ChunkIndex(self.page_bytes)
        self.policy = make_policy(self.policy_name)

    def save_snapshot(self) -> bool:
        """At a clean stop (every job drained): write the index's snapshot for the next start
        (``index_restore``); False when the tier is not idle."""
        return index_restore.save(self, self.db, index_restore.busy(
            chunks_whose_rows_are_to_delete=len(self._to_free),
            pages_to_free=self.pending_free_pages, chunks_on_their_way_out=len(self._doomed)))

    # -- sizes -------------------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return (self.num_pages - self.allocator.free_pages) * self.page_bytes

    def pages_for(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.page_bytes))

    # -- writes (demotion, write-through) ----------------------------------------------------------
    def reserve(self, ikey: Hashable, fingerprint: str, nbytes: int, checksum: bytes
                ) -> ChunkEntry | None:
        if ikey in self.index:
            return None
        pages = self.pages_for(nbytes)
        if pages > self.num_pages:
            return None
        runs = self.allocator.allocate(pages)
        if runs is None:
            self._reclaim(pages)
            runs = self.allocator.allocate(pages)
            if runs is None:
                self.counters["reserve_no_space"] += 1
                return None
        entry = ChunkEntry(ikey=ikey, fingerprint=fingerprint, nbytes=nbytes, runs=runs, owner=0,
                           checksum=checksum)
        self.index.add(entry)
        return entry

    def _reclaim(self, pages: int) -> None:
        """Free at least ``pages`` pages now: evict LRU chunks, then delete their rows (and any
        other rows waiting to go) synchronously — one transaction — before reusing their pages.

        Synchronous because the caller (a demotion) needs the pages now; evicting a little more
        than needed (1/64 of the tier) keeps this to one fsync per many demotions.
        """
        slack = max(1, self.num_pages // 64)
        # A victim the chain holds to cascade further down frees its pages only once it is read:
        # then this reservation fails and the chain writes its chunk to the next tier instead,
        # rather than evicting (and losing) more here.
        self.evict(pages + slack - self.allocator.free_pages - self.pending_free_pages)
        entries = self.take_deletions()
        if entries:
            self.db.delete([e.ikey for e in entries])
            self.deleted(entries)

    def write_job(self, items: list[tuple[ChunkEntry, list[Run]]], arena: Arena
                  ) -> Callable[[], int]:
        """Copy each entry's source arena pages into its pages (every piece of every chunk in
        flight at once, up to the queue depth), make them all durable with one ``fdatasync``, then
        index them in one transaction (shared with the jobs that finish at the same time:
        ``nvme_commit``). All or nothing per job."""
        rows = [IndexRow.of(e.ikey, e.fingerprint, e.nbytes, e.checksum, e.runs) for e, _ in items]

        def job() -> int:
            self.io.run([partial(self.file.write, page, views) for entry, src_runs in items
                         for page, views in _transfers(entry.runs, src_runs, arena,
                                                       self.page_bytes, self._piece_pages)])
            self.file.sync()  # data durable before the rows that name it
            self._rows.insert(rows)  # with the rows of every job that synced meanwhile
            return sum(e.pages for e, _ in items) * self.page_bytes

        return job

    def commit(self, entry: ChunkEntry) -> None:
        entry.state = ChunkState.READY
        self.policy.insert(entry.slot, self.part_of(entry.slot))
        self.index.loosen(entry)
        self.ready_chunks += 1
        self.ready_pages += entry.pages
        self.counters["writes"] += 1

    def abort(self, entry: ChunkEntry) -> None:
        if self.index.holds(entry):
            self.index.discard(entry)
        self.allocator.free(entry.runs)
        self.counters["write_failures"] += 1

    # -- reads (promotion) -------------------------------------------------------------------------
    def read_job(self, entry: ChunkEntry, arena: Arena, dst_runs: list[Run],
                 dst_segments: list[tuple[int, int]]) -> Callable[[], int]:
        """Read the entry's pages into ``dst_runs`` of the arena (its pieces in flight at once),
        then verify the checksum."""

        def job() -> int:
            self.io.run([partial(self.file.read, page, views) for page, views in
                         _transfers(entry.runs, dst_runs, arena, self.page_bytes,
                                    self._piece_pages)])
            if memcpy.checksum(arena.view, dst_segments) != entry.checksum:
                raise IntegrityError(f"chunk {entry.ikey!r}: checksum mismatch on NVMe read")
            return entry.nbytes

        return job

    def acquire(self, entry: ChunkEntry) -> None:
        entry.ref_count += 1

    def release(self, entry: ChunkEntry) -> None:
        entry.ref_count -= 1
        if entry.ref_count == 0:
            if entry.doomed:
                self._doomed.discard(entry)
                self._schedule_free(entry)
            else:
                self.index.loosen(entry)

    # -- removal -----------------------------------------------------------------------------------
    def drop(self, entry: ChunkEntry) -> None:
        """Remove a READY chunk from the index now; its pages come back via ``delete_job``."""
        self.policy.remove(entry.slot)
        self.index.discard(entry)
        self.ready_chunks -= 1
        self.ready_pages -= entry.pages
        self.on_drop(entry)
        if entry.ref_count:
            entry.doomed = True
            self._doomed.add(entry)
        else:
            self._schedule_free(entry)

    def _schedule_free(self, entry: ChunkEntry) -> None:
        self.pending_free_pages += entry.pages
        self._to_free.append(entry)
        self.counters["drops"] += 1

    def take_deletions(self) -> list[ChunkEntry] | None:
        """Chunks whose rows must be deleted before their pages are freed (for one delete job)."""
        if not self._to_free:
            return None
        batch, self._to_free = self._to_free, []
        return batch

    def delete_job(self, entries: list[ChunkEntry]) -> Callable[[], None]:
        ikeys = [e.ikey for e in entries]
        return lambda: self.db.delete(ikeys)

    def deleted(self, entries: list[ChunkEntry]) -> None:
        for entry in entries:
            self.allocator.free(entry.runs)
            self.pending_free_pages -= entry.pages

    def evict(self, pages_needed: int) -> int:
        victims, freed = self.pick_victims(pages_needed)
        for n, entry in enumerate(victims):
            # The chain may hold it to copy it below, or have it stay for now (LowerTier.on_evict):
            # then it and every warmer victim stay, and the caller gets less room than it asked.
            if not self.on_evict(entry):
                freed -= sum(e.pages for e in victims[n:])
                self.counters["evictions_deferred"] += 1
                break
            if entry.ref_count:
                freed -= entry.pages  # freed when the chain releases it
            self.drop(entry)
            self.counters["evictions"] += 1
        return freed

    def delete(self, ikey: Hashable) -> Status:
        slot = self.index.slot(ikey)
        if slot < 0:
            return Status.MISS
        entry = self.index.entry(slot)
        if entry.state is not ChunkState.READY:
            return Status.BUSY
        self.drop(entry)
        return Status.OK

    # -- introspection -----------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        return {  # O(1): running totals, however big the index
            "capacity_bytes": self.capacity_bytes,
            "used_bytes": self.used_bytes,
            "committed_bytes": self.ready_pages * self.page_bytes,
            "chunks": self.ready_chunks,
            "pending_chunks": len(self.index) - self.ready_chunks,
            "direct_io": int(self.direct_io),
            **self.counters,
        }

    def check_invariants(self) -> None:
        self.allocator.check_invariants()
        self.index.check_invariants()
        self.policy.check_invariants()
        owned = [r for e in self.index.values() for r in e.runs]
        owned += [r for e in self._doomed for r in e.runs]
        owned += [r for e in self._to_free for r in e.runs if not e.doomed]
        owned += self.allocator.free_runs()
        owned.sort()
        end = 0
        for start, count in owned:
            assert start >= end, f"NVMe pages {start}.. owned twice"
            end = start + count
        assert end <= self.num_pages
        ready_chunks = ready_pages = 0
        for ikey, entry in self.index.items():
            ready = entry.state is ChunkState.READY
            assert (entry.slot in self.policy) == ready, f"NVMe policy and {ikey!r} disagree"
            ready_chunks += ready
            ready_pages += entry.pages if ready else 0
        assert len(self.policy) == ready_chunks, "NVMe policy and READY chunks disagree"
        assert self.ready_chunks == ready_chunks, "NVMe ready chunk count drifted"
        assert self.ready_pages == ready_pages, "NVMe pages drifted"

    def close(self) -> None:
        self.io.close()
        self.file.close()
        self.db.close()
        os.close(self._lock_fd)


def _transfers(file_runs: list[Run], arena_runs: list[Run], arena: Arena, page_bytes: int,
               piece_pages: int):
    """Pair file pages with arena pages (the i-th page of one with the i-th of the other): yields
    ``(first file page, [arena views])`` per piece of at most ``piece_pages`` contiguous file
    pages, for one preadv/pwritev each."""
    arena_pages = [p for start, count in arena_runs for p in range(start, start + count)]
    i = 0
    for start, count in file_runs:
        for first in range(0, count, piece_pages):
            n = min(piece_pages, count - first)
            yield start + first, _merge(arena.view, arena_pages[i + first:i + first + n],
                                        page_bytes)
        i += count


def _merge(view: memoryview, pages: list[int], page_bytes: int) -> list[memoryview]:
    """Views of consecutive arena pages, merged into as few contiguous views as possible."""
    out = []
    run_start = prev = pages[0]
    for page in pages[1:] + [None]:
        if page is not None and page == prev + 1:
            prev = page
            continue
        out.append(view[run_start * page_bytes:(prev + 1) * page_bytes])
        if page is not None:
            run_start = prev = page
    return out
