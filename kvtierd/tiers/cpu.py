"""The pinned-CPU tier: index, allocation, leases and eviction over one shared-memory arena.

Primitives (all called from the daemon's request loop, never concurrently):

* ``reserve(ikey, fingerprint, nbytes, owner)`` → PENDING entry | a refusal status
* ``commit(entry, checksum)`` | ``abort(entry)``
* ``lookup(ikey, fingerprint)`` → READY entry (touched) | MISS | LAYOUT_MISMATCH
* ``acquire(entry)`` / ``release(entry)`` around every copy out of the arena
* ``pin(entry)`` / ``unpin(entry)`` for leases
* ``delete(ikey)``, ``enforce_watermarks()``, ``check_invariants()``
* the same for a batch of one key space (``kvtierd.tiers.cpu_batch``): ``reserve_many``,
  ``commit_many``, ``acquire_slots`` + ``release_slots`` (reads held by slot), ``release_read``,
  ``delete_many``

Per-tenant quotas (``quota_pages(tenant)``, 0 = none): a tenant's pages (pending included, chunks
on their way to NVMe excluded) may not pass its quota. A reservation that would pass it evicts the
tenant's *own* coldest chunks first, and is refused ``QUOTA_EXCEEDED`` if that cannot make room;
it never evicts another tenant's chunks to pass a quota.

Bytes are copied by the copy engine, outside this class; it only hands out byte ranges.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter
from typing import Callable, Hashable

from kvtierd.eviction import make_policy
from kvtierd.protocol import Status
from kvtierd.tiers.allocator import PageAllocator, Run, trim_runs
from kvtierd.tiers.arena import Arena
from kvtierd.tiers.base import TierIndex
from kvtierd.tiers.cpu_batch import CpuBatchOps
from kvtierd.tiers.cpu_reserved import CpuReservedOps
from kvtierd.tiers.chunk import ChunkEntry, ChunkState, pending_entry, segments, tenant_of
from kvtierd.tiers.compact_index import ACTIVE, RESERVED, ChunkIndex
from kvtierd.tiers import index_restore
from kvtierd.tiers.index_db import ChunkIndexDB, IndexRow

log = logging.getLogger(__name__)


class CpuTier(CpuBatchOps, CpuReservedOps, TierIndex):
    name = "cpu"

    def __init__(
        self,
        arena: Arena,
        page_bytes: int,
        *,
        policy: str = "lru",
        high_watermark: float = 0.95,
        low_watermark: float = 0.90,
        on_evict: Callable[[ChunkEntry], None] | None = None,
        quota_pages: Callable[[str], int] = lambda tenant: 0,
    ) -> None:
        """``demoter`` (set by the tier mover when an NVMe tier exists) is asked for every victim:
        True means it started writing the chunk below, which then leaves via finish_demotion."""
        self.arena = arena
        self.page_bytes = page_bytes
        self.num_pages = arena.nbytes // page_bytes
        self.capacity_bytes = self.num_pages * page_bytes
        self.allocator = PageAllocator(self.num_pages)
        # One order over all chunks, partitioned by tenant (a tenant over its quota evicts its own).
        self.policy = make_policy(policy)
        self.high_pages = int(self.num_pages * high_watermark)
        self.low_pages = int(self.num_pages * low_watermark)
        # What a reservation that finds the arena full sends down at once: down to the low mark.
        self.round_pages = max(1, self.num_pages - self.low_pages)
        self.on_evict = on_evict
        self.policy_name = policy
        # kv-events hook: called for every chunk that leaves the index (evicted, demoted, deleted,
        # dropped after a failed check); set by the daemon only when events are on (unset,
        # DELETE removes compact chunks without building entries: CpuBatchOps.delete_many).
        self.on_remove: Callable[[ChunkEntry], None] | None = None
        self.demoter: Callable[[ChunkEntry], bool] | None = None
        # With a persistent arena: its crash-safe index (rows written at commit, deleted before
        # pages are reused). None: a private arena that dies with the process.
        self.db: ChunkIndexDB | None = None
        self.demoting_pages = 0  # pages of chunks being demoted: free soon, not yet
        self.held_pages = 0  # pages (counted per reference) of chunks copies are reading now
        self.index = ChunkIndex(page_bytes)
        self._doomed: set[ChunkEntry] = set()
        self.counters: Counter[str] = Counter()
        # Running totals, so that stats() and metric scrapes are O(1) however big the index.
        self.ready_chunks = self.ready_pages = 0
        self.pending_chunks = self.pending_pages = 0
        self.set_aside_runs: list[Run] = []  # pages lent out for good (``set_aside``)
        self.quota_pages = quota_pages
        self._parts: dict[int, int] = {}  # interned tenant -> its LRU partition (-1: none)
        # Pages allocated to each tenant's chunks (pending, ready, demoting, doomed-but-read),
        # and of those the pages being demoted (they count as gone for the quota).
        self.tenant_pages: Counter[str] = Counter()
        self.tenant_demoting: Counter[str] = Counter()
        self.quota_rejections: Counter[str] = Counter()

    # -- sizes -----------------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return (self.num_pages - self.allocator.free_pages) * self.page_bytes

    def pages_for(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.page_bytes))

    def segments(self, entry: ChunkEntry) -> list[tuple[int, int]]:
        runs = entry.runs
        if len(runs) == 1:  # most chunks (copy threads ask per item): the run holds the payload
            return [(runs[0][0] * self.page_bytes, entry.nbytes)]
        return segments(runs, entry.nbytes, self.page_bytes)

    # -- writes ----------------------------------------------------------------------------------
    def reserve(
        self, ikey: Hashable, fingerprint: str, nbytes: int, owner: int, slack: int = 0
    ) -> tuple[Status, ChunkEntry | None]:
        """A PENDING entry of ``nbytes``. ``slack``: bytes a promotion's read job would like to
        write after the payload (``LowerTier.read_slack_bytes``); given only as one run of free
        pages (never evicting or exceeding a quota for it), and freed again at ``commit``."""
        existing = self.index.slot(ikey)
        if existing >= 0:
            return self._existing_status(existing, fingerprint, nbytes), None
        pages = self.pages_for(nbytes)
        if pages > self.num_pages:
            return Status.TOO_LARGE, None
        tenant = tenant_of(ikey)
        if not self._within_quota(tenant, pages):
            self.quota_rejections[tenant] += 1
            return Status.QUOTA_EXCEEDED, None
        runs = self._with_slack(tenant, nbytes, slack) if slack else None
        if runs is not None:
            pages = runs[0][1]
        else:
            runs = self.allocator.allocate(pages)
        if runs is None:
            self._make_room(pages)
            runs = self.allocator.allocate(pages)
            if runs is None:
                self.counters["reserve_no_space"] += 1
                return Status.NO_SPACE, None
        entry = pending_entry(ikey, fingerprint, nbytes, runs, owner)
        self.index.add(entry)
        self.pending_chunks += 1
        self.pending_pages += pages
        self.tenant_pages[tenant] += pages
        return Status.OK, entry

    def _with_slack(self, tenant: str, nbytes: int, slack: int) -> list[Run] | None:
        """One run for ``nbytes + slack`` from free pages, if there is one (else None)."""
        padded = self.pages_for(nbytes + slack)
        if not self._within_quota(tenant, padded):
            return None
        run = self.allocator.allocate_run(padded)
        return None if run is None else [run]

    def _trim(self, entry: ChunkEntry) -> None:
        """Free the pages a PENDING entry holds beyond its payload (a promotion's slack)."""
        extra = entry.pages - self.pages_for(entry.nbytes)
        if extra <= 0:
            return
        runs, spare = trim_runs(entry.runs, entry.pages - extra)
        self.allocator.free(spare)
        self.index.set_runs(entry, runs)
        entry.runs, entry.pages = runs, entry.pages - extra
        self.pending_pages -= extra
        self.tenant_pages[tenant_of(entry.ikey)] -= extra

    def set_aside(self, pages: int) -> Run | None:
        """Take ``pages`` free pages as one run out of the tier for good (the chain's bounce pages
        for chunks cascading between lower tiers): counted as used, never a chunk's. None when
        no free run is that long."""
        run = self.allocator.allocate_run(pages)
        if run is not None:
            self.set_aside_runs.append(run)
        return run

    def _make_room(self, pages: int) -> None:
        """A reservation found no free run: evict (or start demoting) what it needs.

        Pages already on their way out (demotions in flight) count as coming back. When they
        cover this reservation it waits for them (the caller parks it); then, with a lower tier,
        the next round is started at once, up to two rounds in flight, so that the tier below is
        writing the next round when this one's pages come free, instead of idling until they are
        filled again (under sustained writes the arena then holds down to 2 rounds below full).
        """
        needed = pages - self.allocator.free_pages - self.demoting_pages
        if needed > 0:
            if self.evict(needed, all_or_nothing=True):
                # Evicting anyway: go down to the low watermark in one go, so that demotions go
                # out in batches (one fdatasync for many chunks), not one victim per PUT item.
                self.enforce_watermarks()
        elif self.demoter is not None and self.demoting_pages < 2 * self.round_pages:
            self.evict(self.round_pages)

    def part_of_tenant(self, tenant_id: int) -> int:
        """A tenant with a quota has its own LRU partition (it evicts its own coldest chunks);
        the others need none. Quotas are fixed for the daemon's life, so this is cached."""
        part = self._parts.get(tenant_id)
        if part is None:
            tenant = self.index.tenant_name(tenant_id)
            part = self._parts[tenant_id] = tenant_id if self.quota_pages(tenant) else -1
        return part

    def tenant_used_pages(self, tenant: str) -> int:
        """What counts against ``tenant``'s quota: its pages, less those being demoted."""
        return self.tenant_pages[tenant] - self.tenant_demoting[tenant]

    def _within_quota(self, tenant: str, pages: int) -> bool:
        """Whether ``pages`` more fit ``tenant``'s quota, evicting its own coldest chunks (never
        another tenant's) if that makes them fit; nothing is evicted when it would not."""
        quota = self.quota_pages(tenant)
        if not quota:
            return True
        over = self.tenant_used_pages(tenant) + pages - quota
        if over <= 0:
            return True
        if pages > quota:
            return False
        self.evict(over, all_or_nothing=True, tenant=tenant)
        return self.tenant_used_pages(tenant) + pages <= quota

    def mark_demoting(self, entry: ChunkEntry) -> None:
        """The entry is being written to NVMe: its pages are on their way out."""
        entry.demoting = True
        self.demoting_pages += entry.pages
        self.tenant_demoting[tenant_of(entry.ikey)] += entry.pages

    def unmark_demoting(self, entry: ChunkEntry) -> None:
        entry.demoting = False
        self.index.loosen(entry)
        self.demoting_pages -= entry.pages
        self.tenant_demoting[tenant_of(entry.ikey)] -= entry.pages

    def _free(self, entry: ChunkEntry) -> None:
        self.allocator.free(entry.runs)
        tenant = tenant_of(entry.ikey)
        self.tenant_pages[tenant] -= entry.pages
        if not self.tenant_pages[tenant]:
            del self.tenant_pages[tenant]

    def _existing_status(self, slot: int, fingerprint: str, nbytes: int) -> Status:
        """A re-PUT of an indexed key: a cheap answer from the columns (no entry built)."""
        index = self.index
        if index.fp_column[slot] != index.fingerprint_id(fingerprint):
            self.counters["layout_mismatch"] += 1
            return Status.LAYOUT_MISMATCH
        if (index.flags[slot] & ACTIVE and index.active[slot].state is ChunkState.PENDING
                or index.flags[slot] & RESERVED):
            return Status.BUSY
        if index.nbytes_of(slot) != nbytes:
            return Status.SIZE_MISMATCH
        self.policy.touch(slot, self.part_of(slot))
        return Status.EXISTS

    def attach_index(self, db: ChunkIndexDB, attached: bool) -> int:
        """Make the tier persistent; if the arena was re-attached, re-index its chunks straight
        into the compact index (they are re-verified on first read). Returns the number of
        chunks recovered."""
        self.db = db
        assert not self.set_aside_runs, "pages are set aside after recovery, never before"
        if not attached or db.reset_reason:
            index_restore.forget(db)  # a snapshot of what this start drops stands for nothing
            db.clear()
            return 0
        loaded, _ = index_restore.restore(self, db, verified=False, reset=self._fresh_index)
        if loaded.allocator is None:
            log.error("arena index names overlapping pages (%s); starting cold", loaded.overlap)
            db.clear()
            self._fresh_index()
            return 0
        self.allocator = loaded.allocator
        if loaded.bad:
            db.delete_stored(loaded.bad)
        self.tenant_pages.clear()
        self.tenant_pages.update(loaded.tenant_pages)
        self.ready_chunks = len(self.index)
        self.ready_pages = loaded.pages
        return len(self.index)

    def _fresh_index(self) -> None:
        self.index.clear()
        self._parts.clear()
        self.policy = make_policy(self.policy_name)

    def save_snapshot(self) -> bool:
        """At a clean stop (every copy drained): write the index's snapshot for the next warm
        start (``index_restore``); False when there is no index or the tier is not idle."""
        return self.db is not None and index_restore.save(self, self.db, index_restore.busy(
            pending_chunks=self.pending_chunks, demoting_pages=self.demoting_pages,
            pages_being_read=self.held_pages, chunks_on_their_way_out=len(self._doomed)))

    def mark_on_nvme(self, below: ChunkIndex) -> int:
        """Warm restart beside an NVMe tier: flag the chunks whose NVMe copy (same key, same
        checksum) exists, so evicting them is free. Returns how many."""
        return self.index.mark_copies(below)

    def commit(self, entry: ChunkEntry, checksum: bytes) -> None:
        assert entry.state is ChunkState.PENDING and self.index.holds(entry)
        if entry.pages != self.pages_for(entry.nbytes):
            self._trim(entry)
        if self.db is not None:  # durable before the PUT is answered
            self.db.insert([IndexRow.of(entry.ikey, entry.fingerprint, entry.nbytes, checksum,
                                        entry.runs)])
        entry.state = ChunkState.READY
        entry.checksum = checksum
        self.pending_chunks -= 1
        self.pending_pages -= entry.pages
        self.ready_chunks += 1
        self.ready_pages += entry.pages
        self.policy.insert(entry.slot, self.part_of(entry.slot))
        self.index.loosen(entry)
        self.counters["commits"] += 1

    def abort(self, entry: ChunkEntry) -> None:
        assert entry.state is ChunkState.PENDING and self.index.holds(entry)
        self.index.discard(entry)
        self._free(entry)
        self.pending_chunks -= 1
        self.pending_pages -= entry.pages
        self.counters["aborts"] += 1

    # -- reads -----------------------------------------------------------------------------------
    def acquire(self, entry: ChunkEntry) -> None:
        entry.ref_count += 1
        self.held_pages += entry.pages

    def release(self, entry: ChunkEntry) -> None:
        assert entry.ref_count > 0, "release without acquire"
        entry.ref_count -= 1
        self.held_pages -= entry.pages
        if entry.ref_count == 0:
            if entry.doomed:
                self._doomed.discard(entry)
                self._free(entry)
            else:
                self.index.loosen(entry)

    # -- removal ---------------------------------------------------------------------------------
    def delete(self, ikey: Hashable) -> Status:
        slot = self.index.slot(ikey)
        if slot < 0:
            return Status.MISS
        entry = self.index.entry(slot)
        if entry.state is ChunkState.PENDING:
            return Status.BUSY
        self._remove(entry)
        self.counters["deletes"] += 1
        return Status.OK

    def _remove(self, entry: ChunkEntry, row_deleted: bool = False) -> None:
        if self.db is not None and not row_deleted:  # the row goes before its pages are reused
            self.db.delete([entry.ikey])
        if self.on_remove is not None:
            self.on_remove(entry)  # kv-events hook
        self.policy.remove(entry.slot)
        by_slot = self.index.reads.get(entry.slot)
        if by_slot:  # copies read it by slot: their releases now go through this (doomed) entry
            entry.ref_count += by_slot
        self.index.discard(entry)
        self.ready_chunks -= 1
        self.ready_pages -= entry.pages
        if entry.ref_count:
            entry.doomed = True
            self._doomed.add(entry)
        else:
            self._free(entry)

    def evict(self, pages_needed: int, all_or_nothing: bool = False,
              tenant: str | None = None) -> int:
        """Evict cold, unpinned, unreferenced chunks (only ``tenant``'s, if given) until
        ``pages_needed`` pages are freed.

        With ``all_or_nothing`` (a PUT making room) nothing is evicted unless enough can be: a PUT
        that fails anyway must not empty the cache on its way.
        """
        slots, freed = self.victim_slots(pages_needed, tenant)
        if all_or_nothing and freed < pages_needed:
            return 0
        gone = []
        for slot in slots:
            entry = self.index.entry(slot)
            if self.demoter is not None and self.demoter(entry):
                # No longer a candidate: later scans must not walk past it again.
                self.policy.remove(slot)
                self.counters["demotions_started"] += 1
                continue
            gone.append(entry)
        if gone and self.db is not None:  # one transaction for the rows of every victim
            self.db.delete([entry.ikey for entry in gone])
        for entry in gone:
            self._remove(entry, row_deleted=True)
            self.counters["evictions"] += 1
            if self.on_evict is not None:
                self.on_evict(entry)
        return freed

    def finish_demotion(self, entry: ChunkEntry) -> None:
        """The chunk's NVMe copy is durable (or failed): it leaves the arena now."""
        if self.index.holds(entry):
            self._remove(entry)
            self.counters["evictions"] += 1

    def enforce_watermarks(self) -> int:
        used = self.num_pages - self.allocator.free_pages - self.demoting_pages
        if used <= self.high_pages:
            return 0
        return self.evict(used - self.low_pages)

    # -- introspection ---------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        return {
            "capacity_bytes": self.capacity_bytes,
            "used_bytes": self.used_bytes,
            "committed_bytes": self.ready_pages * self.page_bytes,
            "pending_bytes": self.pending_pages * self.page_bytes,
            "chunks": self.ready_chunks,
            "pending_chunks": self.pending_chunks,
            "doomed_chunks": len(self._doomed),
            "demoting_bytes": self.demoting_pages * self.page_bytes,
            **{k: v for k, v in self.counters.items()},
        }

    def tenant_stats(self) -> dict[str, dict[str, int]]:
        """Per tenant with pages or refusals: bytes counted against its quota, its quota and its
        refusals (O(tenants), not O(chunks))."""
        return {
            tenant: {
                "used_bytes": self.tenant_used_pages(tenant) * self.page_bytes,
                "quota_bytes": self.quota_pages(tenant) * self.page_bytes,
                "quota_rejections": self.quota_rejections[tenant],
            }
            for tenant in sorted(set(self.tenant_pages) | set(self.quota_rejections))
        }

    def check_invariants(self) -> None:
        """O(chunks): compact chunks are checked through read-only snapshots."""
        self.allocator.check_invariants()
        self.index.check_invariants()
        owned: list[tuple[int, int]] = []
        ready_chunks = ready_pages = pending_chunks = pending_pages = candidates = 0
        for ikey, entry in self.index.items():
            assert entry.ikey == ikey and not entry.doomed, f"index entry {ikey!r} is inconsistent"
            assert (entry.pages == self.pages_for(entry.nbytes) or (
                entry.state is ChunkState.PENDING and len(entry.runs) == 1
                and entry.pages > self.pages_for(entry.nbytes))), (
                f"{ikey!r} has wrong page count")  # a promotion's slack: one run, trimmed at commit
            assert entry.ref_count >= 0 and entry.pin_count >= 0
            owned.extend(entry.runs)
            candidate = entry.state is ChunkState.READY and not entry.demoting
            assert (entry.slot in self.policy) == candidate, (
                f"{ikey!r}: eviction policy membership {entry.slot in self.policy}, "
                f"candidate {candidate}")
            candidates += candidate
            if entry.state is ChunkState.READY:
                ready_chunks += 1
                ready_pages += entry.pages
            else:
                pending_chunks += 1
                pending_pages += entry.pages
        for entry in self._doomed:
            assert entry.doomed and entry.ref_count > 0, "doomed entry without readers"
            owned.extend(entry.runs)
        assert all(entry in self._doomed for entry in self.index.retired.values()), (
            "a retired slot's entry is not doomed")
        reads = self.index.reads  # a retired slot's reads are counted on its doomed entry
        held = sum((entry.ref_count + reads.get(entry.slot, 0)) * entry.pages
                   for entry in self.index.values())
        held += sum(entry.ref_count * entry.pages for entry in self._doomed)
        assert held == self.held_pages, f"held pages drifted: {self.held_pages}, held {held}"
        owned.extend(self.allocator.free_runs())
        owned.extend(self.set_aside_runs)
        owned.sort()
        end = 0
        for start, count in owned:
            assert start == end, f"pages {end}..{start} lost or owned twice"
            end = start + count
        assert end == self.num_pages, f"pages {end}..{self.num_pages} are owned by nobody"
        assert self.ready_chunks == ready_chunks, "ready chunk count drifted"
        assert self.ready_pages == ready_pages, "ready pages drifted"
        assert self.pending_chunks == pending_chunks, "pending chunk count drifted"
        assert self.pending_pages == pending_pages, "pending pages drifted"
        assert len(self.policy) == candidates, "eviction policy and READY chunks disagree"
        self._check_tenants()
        self.policy.check_invariants()

    def _check_tenants(self) -> None:
        pages: Counter[str] = Counter()
        demoting: Counter[str] = Counter()
        for entry in itertools.chain(self.index.values(), self._doomed):  # one snapshot at a time
            pages[tenant_of(entry.ikey)] += entry.pages
            if entry.demoting:
                demoting[tenant_of(entry.ikey)] += entry.pages
        nonzero = {t: n for t, n in self.tenant_pages.items() if n}  # negatives are drift too
        assert nonzero == pages, (
            f"per-tenant pages drifted: counted {dict(self.tenant_pages)}, held {dict(pages)}")
        assert {t: n for t, n in self.tenant_demoting.items() if n} == demoting, (
            "per-tenant demoting pages drifted")
        aside = sum(count for _, count in self.set_aside_runs)
        assert sum(pages.values()) == self.num_pages - self.allocator.free_pages - aside, (
            "tenants' pages and the allocator disagree")
