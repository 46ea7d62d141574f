"""The CPU tier's PUT reservations held by slot: ``reserve_slots``, ``commit_slots``,
``abort_slots``.

Why: at 16 KiB building a ``ChunkEntry`` per reserved chunk, committing it and folding it back into
the compact index was a third of a PUT item's loop CPU, for an object nothing but the copy job
looks at. Where nothing wants the entries (no kv-events, no tier below), a PUT group of new keys is
reserved as index columns alone (``ChunkIndex.reserved``), copied as columns and committed straight
into compact READY form; every reader sees a reservation as PENDING, and whoever asks for its entry
gets a PENDING one that then stands for it (``ChunkIndex.entry``). The unit tests run the same
random scenarios through these and through ``reserve`` / ``commit`` / ``abort`` and compare.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from kvtierd.tiers.chunk import ChunkState
from kvtierd.tiers.index_db import IndexRow

if TYPE_CHECKING:
    from kvtierd.tiers.cpu import CpuTier

_READY, _PENDING = ChunkState.READY, ChunkState.PENDING


class CpuReservedOps:
    """Mixin of ``CpuTier`` (``kvtierd.tiers.cpu``)."""

    def reserve_slots(self: CpuTier, space: tuple, keys: Sequence[bytes], nbytes: int,
                      fingerprint: str) -> tuple[list[int], list[int]]:
        """``reserve`` of the first items of a batch of new keys of ``nbytes`` each, held by slot
        (``ChunkIndex.reserved``): no entry object, no owner (nothing reads it; the copy job that
        holds the slots commits or aborts them: ``commit_slots``, ``abort_slots``).

        Only where each item's ``reserve`` would place it without evicting: keys distinct and
        none indexed, a tenant without a quota, free runs for them; items are placed in order
        up to the first that finds no run. Returns the slots and their payloads' arena byte
        offsets, for that prefix (empty lists: the caller reserves them as entries, which
        evicts or refuses as ``reserve`` does)."""
        pages = self.pages_for(nbytes)
        index = self.index
        found = index.key_space(space)
        if (not keys or pages > self.num_pages or self.quota_pages(space[0])
                or len(set(keys)) != len(keys)
                or (found is not None and not found.keys.keys().isdisjoint(keys))):
            return [], []
        extents = self.allocator.allocate_extents(pages, len(keys))
        if not extents:
            return [], []
        starts: list[int] = []
        offsets: list[int] = []
        page = self.page_bytes
        for first, runs in extents:  # first pages and arena offsets, a range per stretch
            starts.extend(range(first, first + runs * pages, pages))
            offsets.extend(range(first * page, (first + runs * pages) * page, pages * page))
        placed = len(starts)
        slots = index.add_pending(space, fingerprint, keys[:placed] if placed < len(keys)
                                  else keys, [nbytes] * placed, starts, by_slot=True)
        self._count_placed(space, placed, pages)
        return slots, offsets

    def commit_slots(self: CpuTier, space: tuple, fingerprint: str, keys: Sequence[bytes],
                     slots: list[int], checksums: Sequence[bytes], nbytes: int) -> None:
        """``commit`` of reservations held by slot (``reserve_slots``: ``keys`` of ``space`` and
        ``fingerprint``, ``nbytes`` each, at ``slots``) with their checksums, in order: one index
        transaction (durable before any is READY), the columns written, one policy call. A
        reservation that someone turned into an entry meanwhile (``ChunkIndex.entry``) is
        committed as that entry."""
        index = self.index
        if self.db is not None:
            pages_each = self.pages_for(nbytes)
            starts = index.start_column
            self.db.insert([IndexRow.of((space, key), fingerprint, nbytes, checksum,
                                        [(starts[slot], pages_each)])
                            for key, slot, checksum in zip(keys, slots, checksums)])
        if not slots:
            return
        reserved = index.reserved
        if reserved.issuperset(slots):  # nobody asked for any of them (always, in practice)
            index.commit_reserved(slots, checksums)
        else:
            mine: list[int] = []
            sums: list[bytes] = []
            for slot, checksum in zip(slots, checksums):
                if slot in reserved:
                    mine.append(slot)
                    sums.append(checksum)
                else:  # an entry now: what ``commit`` does to it, but for the counters below
                    entry = index.active[slot]
                    assert entry.state is _PENDING, f"reserved slot {slot} left PENDING"
                    entry.state = _READY
                    entry.checksum = checksum
                    index.loosen(entry)
            index.commit_reserved(mine, sums)
        self.policy.insert_many(slots, self.part_of(slots[0]))
        count = len(slots)
        pages = count * self.pages_for(nbytes)
        self.pending_chunks -= count
        self.pending_pages -= pages
        self.ready_chunks += count
        self.ready_pages += pages
        self.counters["commits"] += count

    def abort_slots(self: CpuTier, slots: Sequence[int]) -> None:
        """``abort`` of reservations held by slot (their copy failed, or the session ended)."""
        entry = self.index.entry
        for slot in slots:
            self.abort(entry(slot))
