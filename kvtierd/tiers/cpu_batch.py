"""The CPU tier's primitives for a whole batch of one key space: reserve, commit, acquire and
release, delete.

Why: at 16 KiB a chunk's memcpy takes ~2 µs, and the per-item primitives (``reserve``,
``commit``, ``lookup`` + ``acquire``, ``release``, ``delete``) cost several times that in Python
calls, entry objects and counter updates. These do the same state changes, item by item in item
order, with the per-batch work done once: one pass of the allocator for many equal-sized chunks,
one partition and quota decision per key space, counters and index rows once per call, no entry
object for a chunk that is only deleted. Each has the semantics (statuses, eviction, invariants)
of calling its per-item primitive on every item in order; the unit tests compare the two.
"""

from __future__ import annotations

from itertools import repeat
from typing import TYPE_CHECKING, Sequence

from kvtierd.protocol import Status
from kvtierd.tiers.chunk import ChunkEntry, ChunkState, pending_entry
from kvtierd.tiers.compact_index import ACTIVE, MULTI, RESERVED, VERIFIED
from kvtierd.tiers.columns import same_at, take_at
from kvtierd.tiers.index_db import IndexRow
from kvtierd.tiers.index_parts import KeySpace

if TYPE_CHECKING:
    from kvtierd.tiers.cpu import CpuTier

_MISS, _MISMATCH, _SIZE, _BUSY = (int(Status.MISS), int(Status.LAYOUT_MISMATCH),
                                  int(Status.SIZE_MISMATCH), int(Status.BUSY))
_OK = int(Status.OK)
#: flags byte -> 1 where a compact chunk cannot be held by slot (several runs, or unverified)
_NOT_HELD_BY_SLOT = bytes(0 if f & (MULTI | VERIFIED) == VERIFIED else 1 for f in range(256))
_READY, _PENDING = ChunkState.READY, ChunkState.PENDING
#: Allocator passes per reserve_many before the rest goes item by item: each pass after the first
#: follows an eviction down to the low watermark, so a batch rarely needs more than two.
_FAST_ROUNDS = 8


class CpuBatchOps:
    """Mixin of ``CpuTier`` (``kvtierd.tiers.cpu``)."""

    def reserve_many(self: CpuTier, space: tuple, keys: Sequence[bytes],
                     sizes: Sequence[int], fingerprint: str, owner: int
                     ) -> list[tuple[Status, ChunkEntry | None]]:
        """``reserve((space, key), fingerprint, nbytes, owner)`` for each item, in order.

        Equal-sized items of a tenant without a quota (the common batch) take their pages in one
        allocator pass (``PageAllocator.allocate_many``: the same runs the per-item first fit
        gives) for as many items as it can place; the first item it cannot place goes through
        ``reserve``, which evicts, and the items after it are looked at again (the eviction may
        have removed some of their keys), exactly as one-by-one reservation sees them. Every
        other batch goes through ``reserve`` item by item."""
        n = len(keys)
        if not n:
            return []
        pages = self.pages_for(sizes[0])
        out: list[tuple[Status, ChunkEntry | None]] = [(Status.OK, None)] * n
        if (self.pages_for(max(sizes)) != pages or self.pages_for(min(sizes)) != pages
                or pages > self.num_pages or self.quota_pages(space[0])):
            return self._reserve_each(out, 0, space, keys, sizes, fingerprint, owner)
        pos = 0
        for _ in range(_FAST_ROUNDS):
            pos = self._reserve_run(out, pos, pages, space, keys, sizes, fingerprint, owner)
            if pos >= n:
                return out
            # Item ``pos`` found no single run: one by one, evicting as reserve does.
            out[pos] = self.reserve((space, keys[pos]), fingerprint, sizes[pos], owner)
            pos += 1
            if pos >= n or self.allocator.free_pages < pages:
                break
        return self._reserve_each(out, pos, space, keys, sizes, fingerprint, owner)

    def _reserve_each(self: CpuTier, out: list, pos: int, space: tuple, keys: Sequence[bytes],
                      sizes: Sequence[int], fingerprint: str, owner: int) -> list:
        for i in range(pos, len(keys)):
            out[i] = self.reserve((space, keys[i]), fingerprint, sizes[i], owner)
        return out

    def _reserve_run(self: CpuTier, out: list, pos: int, pages: int, space: tuple,
                     keys: Sequence[bytes], sizes: Sequence[int], fingerprint: str,
                     owner: int) -> int:
        """Reserve items ``pos..`` of ``pages`` pages each without evicting, up to the first one
        that finds no single run; returns its position (``len(keys)``: all done)."""
        index = self.index
        found = index.key_space(space)
        known = found.keys if found is not None else {}
        rest = keys[pos:] if pos else keys
        if len(set(rest)) == len(rest) and known.keys().isdisjoint(rest):
            # Every key new and distinct (a fresh PUT batch): one entry per item, in C loops.
            runs = self.allocator.allocate_many(pages, len(rest))
            end = pos + len(runs)
            placed, lengths = rest[:len(runs)], sizes[pos:end]
            slots = index.add_pending(space, fingerprint, placed, lengths,
                                      [run[0] for run in runs])
            # pending_entry's fields (and the slot), without its frame: one C loop
            entries = list(map(ChunkEntry, zip(repeat(space), placed), repeat(fingerprint),
                               lengths, [[run] for run in runs], repeat(owner), repeat(_PENDING),
                               repeat(b""), repeat(0), repeat(0), repeat(False), repeat(False),
                               repeat(False), repeat(True), slots))
            index.active.update(zip(slots, entries))
            out[pos:end] = zip(repeat(Status.OK), entries)
            self._count_placed(space, len(entries), pages)
            return end
        fresh: dict[bytes, int] = {}  # key -> position, for the items that need pages
        for i in range(pos, len(keys)):  # side-effect free: what each item will be
            key = keys[i]
            if key not in fresh and known.get(key, -1) < 0:
                fresh[key] = i
        runs = self.allocator.allocate_many(pages, len(fresh)) if fresh else []
        end = len(keys) if len(runs) == len(fresh) else list(fresh.values())[len(runs)]
        entries = []
        for i in range(pos, end):
            key = keys[i]
            slot = known.get(key, -1)
            if slot >= 0:
                out[i] = (self._existing_status(slot, fingerprint, sizes[i]), None)
            elif fresh[key] != i:  # twice in one batch: the first is PENDING when the second comes
                out[i] = (Status.BUSY, None)
            else:
                entry = pending_entry((space, key), fingerprint, sizes[i], [runs[len(entries)]],
                                      owner)
                entries.append(entry)
                out[i] = (Status.OK, entry)
        self._placed(space, fingerprint, entries, pages)
        return end

    def _placed(self: CpuTier, space: tuple, fingerprint: str, entries: list[ChunkEntry],
                pages: int) -> None:
        """Index new PENDING entries of ``pages`` pages each and count them."""
        if entries:
            self.index.add_many(space, fingerprint, entries)
            self._count_placed(space, len(entries), pages)

    def _count_placed(self: CpuTier, space: tuple, placed: int, pages: int) -> None:
        self.pending_chunks += placed
        self.pending_pages += placed * pages
        self.tenant_pages[space[0]] += placed * pages

    def commit_many(self: CpuTier, entries: list[ChunkEntry], checksums: Sequence[bytes],
                    fold: bool = False) -> None:
        """``commit`` of each entry with its checksum, in order: one index transaction (durable
        before any is READY, so before the PUT is answered) and the counters once. ``fold``:
        the caller holds none of the entries after this call, so they go straight back to
        compact form (``ChunkIndex.fold``) instead of waiting for the next ``compact``."""
        active = self.index.active
        for entry in entries:
            assert entry.state is _PENDING and active.get(entry.slot) is entry, (
                f"commit of {entry.ikey!r}, which is not a PENDING indexed chunk")
        if self.db is not None:
            self.db.insert([IndexRow.of(entry.ikey, entry.fingerprint, entry.nbytes, checksum,
                                        entry.runs) for entry, checksum in zip(entries, checksums)])
        if not entries:
            return
        first = entries[0].ikey[0]
        one_space = True
        slots: list[int] = []
        pages = 0
        for entry, checksum in zip(entries, checksums):
            entry.state = _READY
            entry.checksum = checksum
            pages += entry.pages
            slots.append(entry.slot)
            space = entry.ikey[0]
            if space is not first and space != first:
                one_space = False
        if one_space:  # one partition (a PUT batch): the policy takes them in one call
            self.policy.insert_many(slots, self.part_of(slots[0]))
        else:
            parts: dict[tuple, int] = {}
            for entry in entries:
                part = parts.get(entry.ikey[0])
                if part is None:
                    part = parts[entry.ikey[0]] = self.part_of(entry.slot)
                self.policy.insert(entry.slot, part)
        if fold:
            self.index.fold(entries)
        else:
            self.index.loosen_slots(slots)
        count = len(entries)
        self.pending_chunks -= count
        self.pending_pages -= pages
        self.ready_chunks += count
        self.ready_pages += pages
        self.counters["commits"] += count

    def acquire_slots(self: CpuTier, space: tuple, keys: Sequence[bytes], sizes: Sequence[int],
                      fingerprint: str) -> tuple[list[ChunkEntry | int], list[int], int]:
        """``lookup((space, key), fingerprint)`` then, for a hit of the asked size, ``acquire``,
        for each item in order, for a reader that needs only byte ranges (a GET into shared
        staging): a hit whose payload is one run and needs no first-read check is held by its
        slot (``index.reads``), with no entry built, so nothing is folded back afterwards. Every
        hit is held before the call returns, so a copy completing inline meanwhile cannot evict
        a chunk the caller is about to read.

        Returns per item the payload's arena byte offset (an int >= 0: held by slot), an
        acquired entry (a chunk over several runs or one to verify on its first read: release it
        with ``release_read``), or its status negated (-MISS, -LAYOUT_MISMATCH, -SIZE_MISMATCH);
        then the held slots in item order and the pages they hold, for ``release_slots``. Hits
        are touched (size mismatches too, as ``lookup`` touches them) in one policy call; a held
        slot is never evicted, and a DELETE meanwhile dooms its chunk as it dooms an acquired
        entry."""
        index = self.index
        found = index.key_space(space)
        if found is None:
            return [-_MISS] * len(keys), [], 0
        plain = self._acquire_plain(found, keys, sizes, fingerprint)
        if plain is not None:
            return plain
        get, active, fps, flags = found.keys.get, index.active, index.fp_column, index.flags
        starts, lengths, reads = index.start_column, index.nbytes_column, index.reads
        fp, activate, page = index.fingerprint_id(fingerprint), index.activate, self.page_bytes
        out: list[ChunkEntry | int] = []
        held: list[int] = []
        hits: list[int] = []
        pages = entry_pages = mismatches = 0
        for key, nbytes in zip(keys, sizes):
            slot = get(key, -1)
            if slot < 0:
                out.append(-_MISS)
                continue
            flag = flags[slot]
            if flag & ACTIVE:
                entry = active[slot]
                if entry.state is not _READY:
                    out.append(-_MISS)
                    continue
                if entry.fingerprint != fingerprint:
                    out.append(-_MISMATCH)
                    mismatches += 1
                    continue
                hits.append(slot)
                if entry.nbytes != nbytes:
                    out.append(-_SIZE)
                elif entry.verified and len(entry.runs) == 1:
                    reads[slot] = reads.get(slot, 0) + 1
                    held.append(slot)
                    pages += entry.pages
                    out.append(starts[slot] * page)
                else:
                    entry.ref_count += 1
                    entry_pages += entry.pages
                    out.append(entry)
                continue
            if flag & RESERVED:  # a PUT's reservation held by slot: PENDING, a miss
                out.append(-_MISS)
                continue
            if fps[slot] != fp:  # compact and not reserved: READY
                out.append(-_MISMATCH)
                mismatches += 1
                continue
            hits.append(slot)
            if lengths[slot] != nbytes:
                out.append(-_SIZE)
            elif flag & (MULTI | VERIFIED) == VERIFIED:
                reads[slot] = reads.get(slot, 0) + 1
                held.append(slot)
                pages += -(-nbytes // page) or 1
                out.append(starts[slot] * page)
            else:
                entry = activate(slot, (space, key), fingerprint)
                entry.ref_count += 1
                entry_pages += entry.pages
                out.append(entry)
        self.held_pages += pages + entry_pages
        if hits:
            self.policy.touch_many(hits, self.part_of_tenant(found.tenant))
        if mismatches:
            self.counters["layout_mismatch"] += mismatches
        return out, held, pages

    def _acquire_plain(self: CpuTier, found: KeySpace, keys: Sequence[bytes],
                       sizes: Sequence[int], fingerprint: str
                       ) -> tuple[list[ChunkEntry | int], list[int], int] | None:
        """``acquire_slots`` of a batch whose every key is a distinct, compact, verified
        one-run chunk of the reader's layout and size, none read by slot yet (a GET of what a
        PUT stored): what its per-key loop gives, in C loops over the columns. None when any key
        is not (the loop then goes key by key)."""
        index = self.index
        slots = list(map(found.keys.get, keys, repeat(-1)))
        n = len(slots)
        if (not n or -1 in slots or len(set(slots)) != n
                or (index.active and not index.active.keys().isdisjoint(slots))
                or (index.reserved and not index.reserved.isdisjoint(slots))
                or (index.reads and not index.reads.keys().isdisjoint(slots))):
            return None
        fp = index.fingerprint_id(fingerprint)
        if not index.fingerprint_covers_all(fp) and same_at(index.fp_column, slots) != fp:
            return None
        one_size = sizes.count(sizes[0]) == n  # most batches: compared without a list
        if (same_at(index.nbytes_column, slots) != sizes[0] if one_size
                else take_at(index.nbytes_column, slots) != list(sizes)):
            return None
        if 1 in take_at(index.flags, slots).translate(_NOT_HELD_BY_SLOT):
            return None
        index.reads.update(zip(slots, repeat(1)))
        page = self.page_bytes
        if one_size:
            pages = n * (-(-sizes[0] // page) or 1)
        else:
            pages = sum([-(-nbytes // page) or 1 for nbytes in sizes])
        self.held_pages += pages
        self.policy.touch_many(slots, self.part_of_tenant(found.tenant))
        offsets = take_at(index.start_column, slots, page)  # first pages as arena offsets
        return offsets, slots, pages

    def release_slots(self: CpuTier, slots: Sequence[int], pages: int) -> None:
        """Release reads held by slot (``acquire_slots``): ``slots`` as it returned them,
        ``pages`` the pages it said they hold. A slot whose chunk left the index meanwhile
        releases its doomed entry (freed with its last reader) and, with its last read, the
        slot itself."""
        reads, retired = self.index.reads, self.index.retired
        if not retired:  # nothing left the index meanwhile (nearly always): pops in C
            counts = list(map(reads.pop, slots, repeat(0)))
            if counts.count(1) == len(counts):  # each slot read once, by this job alone
                self.held_pages -= pages
                return
            for slot, count in zip(slots, counts):  # else undone, and the loop below does it
                if count:
                    reads[slot] = count
        for slot in slots:
            left = reads.pop(slot) - 1
            if left:
                reads[slot] = left
            if retired:
                entry = retired.get(slot)
                if entry is not None:
                    entry.ref_count -= 1
                    if not entry.ref_count:
                        self._doomed.discard(entry)
                        self._free(entry)
                    if not left:
                        self.index.release_retired(slot)
        self.held_pages -= pages

    def release_read(self: CpuTier, entries: Sequence[ChunkEntry]) -> int:
        """``release`` of each entry whose bytes were just served (so they passed any first-read
        check: ``verified``); returns the bytes served."""
        loose = self.index.loosen
        served = pages = 0
        for entry in entries:
            assert entry.ref_count > 0, "release without acquire"
            entry.ref_count -= 1
            entry.verified = True
            pages += entry.pages
            served += entry.nbytes
            if not entry.ref_count:
                if entry.doomed:
                    self._doomed.discard(entry)
                    self._free(entry)
                else:
                    loose(entry)
        self.held_pages -= pages
        return served

    def delete_many(self: CpuTier, space: tuple, keys: Sequence[bytes],
                    fingerprint: str) -> list[int]:
        """DELETE of each key by a reader of ``fingerprint``, in order, as the chain does it
        without lower tiers: per key OK, MISS, BUSY (PENDING) or LAYOUT_MISMATCH (written by
        another layout: left alone), as an int. Compact one-run chunks leave together from their
        columns (``_drop_plain``), with no entry built; the index rows of every removed chunk go
        in one transaction before any of their pages is freed. A batch of distinct keys that are
        all such chunks (the DELETE of what a PUT stored) is recognised in C-level passes and
        removed without a per-key status decision."""
        index = self.index
        found = index.key_space(space)
        if found is None or not keys:
            return [_MISS] * len(keys)
        fp = index.fingerprint_id(fingerprint)
        # Without rows to delete first, the keys leave the index as they are looked up.
        take = self.db is None
        plain = (None if self.on_remove is not None
                 else index.plain_slots(found, keys, fp, take=take))
        if plain is not None:
            if self.db is not None:  # the rows go before their pages are reused
                self.db.delete([(space, key) for key in keys])
            self._drop_plain(found, keys, plain, fp, taken=take)
            self.counters["deletes"] += len(keys)
            return [_OK] * len(keys)
        get, active, fps, flags = found.keys.get, index.active, index.fp_column, index.flags
        out: list[int] = []
        gone: dict[bytes, int] = {}  # key -> slot, in order
        mismatches = 0
        for key in keys:
            slot = get(key, -1)
            if slot < 0 or key in gone:
                out.append(_MISS)
                continue
            entry = active.get(slot) if flags[slot] & ACTIVE else None
            if entry is None and flags[slot] & RESERVED:  # a reservation held by slot: PENDING
                out.append(_BUSY)
                continue
            if entry is None:
                ok = fps[slot] == fp
            elif entry.state is _PENDING:
                out.append(_BUSY)
                continue
            else:
                ok = entry.fingerprint == fingerprint
            if not ok:
                out.append(_MISMATCH)
                mismatches += 1
                continue
            gone[key] = slot
            out.append(_OK)
        if mismatches:
            self.counters["layout_mismatch"] += mismatches
        if not gone:
            return out
        if self.db is not None:  # the rows go before their pages are reused
            self.db.delete([(space, key) for key in gone])
        plain_keys: list[bytes] = []
        plain_slots: list[int] = []
        reads = index.reads
        for key, slot in gone.items():
            if (flags[slot] & (ACTIVE | MULTI) or self.on_remove is not None
                    or slot in reads):
                # an object, several runs, a hook that wants an entry, or copies reading it
                # by slot (it is doomed): one at a time
                self._remove(index.entry(slot), row_deleted=True)
            else:
                plain_keys.append(key)
                plain_slots.append(slot)
        if plain_slots:
            self._drop_plain(found, plain_keys, plain_slots, fp)
        self.counters["deletes"] += len(gone)
        return out

    def _drop_plain(self: CpuTier, found: KeySpace, keys: Sequence[bytes], slots: list[int],
                    fp: int, taken: bool = False) -> None:
        """Remove plain chunks (``ChunkIndex.plain_slots``) whose rows are gone: out of the
        policy, the index and the allocator, each in one call, and the counters once."""
        self.policy.remove_many(slots)
        starts, counts, pages = self.index.discard_plain(found, keys, slots, fp, taken)
        self.allocator.free_starts(starts, counts)
        self.ready_chunks -= len(slots)
        self.ready_pages -= pages
        tenant = found.space[0]
        self.tenant_pages[tenant] -= pages
        if not self.tenant_pages[tenant]:
            del self.tenant_pages[tenant]
