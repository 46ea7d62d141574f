"""What every tier's index does alike: find a READY chunk for a reader of one layout, pick the
coldest evictable chunks, fold idle entries back into the compact index."""

from __future__ import annotations

from collections import Counter
from itertools import repeat
from typing import Callable, Hashable, Sequence

from kvtierd.eviction.base import EvictionPolicy
from kvtierd.protocol import Status
from kvtierd.tiers.chunk import ChunkEntry, ChunkState
from kvtierd.tiers.compact_index import ACTIVE, RESERVED, ChunkIndex
from kvtierd.tiers.columns import take_at

MISS_SLOT = -1  # lookup_slots: no READY chunk under the key
MISMATCH_SLOT = -2  # lookup_slots: a chunk written by another layout


class TierIndex:
    """Mixin: needs ``index`` (a ChunkIndex), ``policy`` and ``counters`` on the tier."""

    index: ChunkIndex
    policy: EvictionPolicy
    counters: Counter[str]

    def part_of_tenant(self, tenant_id: int) -> int:
        """The eviction-policy partition of an interned tenant: -1 (none) unless the tier
        evicts per tenant (the CPU tier, for tenants with a quota)."""
        return -1

    def part_of(self, slot: int) -> int:
        return self.part_of_tenant(self.index.tenant_id(slot))

    def lookup(self, ikey: Hashable, fingerprint: str) -> tuple[Status, ChunkEntry | None]:
        """The READY chunk under ``ikey`` (touched for the eviction policy), a MISS, or
        LAYOUT_MISMATCH when it was written by another layout: never bytes for the wrong reader."""
        index = self.index
        slot = index.slot(ikey)
        if slot < 0 or index.flags[slot] & RESERVED:  # not indexed, or a PUT's reservation
            return Status.MISS, None
        entry = index.entry(slot)
        if entry.state is not ChunkState.READY:
            return Status.MISS, None
        if entry.fingerprint != fingerprint:
            self.counters["layout_mismatch"] += 1
            return Status.LAYOUT_MISMATCH, None
        self.policy.touch(slot, self.part_of(slot))
        return Status.OK, entry

    def lookup_slots(self, space: tuple, keys: Sequence[bytes], fingerprint: str,
                     check: Callable[[list[int]], None] | None = None) -> list[int]:
        """Batched ``lookup`` for one key space without building entries: per key the slot of its
        READY chunk (touched, in key order), MISS_SLOT or MISMATCH_SLOT. ``index.entry(slot)``
        gives the entry of a hit (e.g. to lease it). ``check(slots)`` runs on the first answer
        (a slot per indexed key, MISS_SLOT otherwise) before anything is touched or counted when
        some key is not indexed, and may raise to refuse the batch: the LOOKUP handler validates
        only the keys that missed (an indexed key was validated when it was stored).

        Why it is written this way: a 1024-key LOOKUP must cost well under a microsecond a key,
        so the common case (every hit an idle READY chunk of the reader's layout) runs as C loops
        (``map``, ``in``) and an O(1) layout check; only a batch that meets a PENDING chunk or
        another layout takes the per-key path."""
        index = self.index
        found = index.key_space(space)
        if found is None:
            out = [MISS_SLOT] * len(keys)
            if check is not None:
                check(out)
            return out
        out = list(map(found.keys.get, keys, repeat(MISS_SLOT, len(keys))))
        if MISS_SLOT in out:
            if check is not None:
                check(out)
            hits = [slot for slot in out if slot >= 0]
        else:  # every key indexed: nothing for ``check`` to refuse
            hits = out
        fp = index.fingerprint_id(fingerprint)
        part = self.part_of_tenant(found.tenant)
        active, fps, reserved = index.active, index.fp_column, index.reserved
        if ((not active or active.keys().isdisjoint(hits))
                and (not reserved or reserved.isdisjoint(hits))
                and (index.fingerprint_covers_all(fp)
                     or take_at(fps, hits).count(fp) == len(hits))):
            # Every hit is an idle READY chunk of this layout.
            self.policy.touch_many(hits, part)
            return out
        ready, flags = ChunkState.READY, index.flags
        hits = []
        mismatches = 0
        for i, slot in enumerate(out):
            if slot < 0:
                continue
            if (flags[slot] & ACTIVE and active[slot].state is not ready) or flags[slot] & RESERVED:
                # PENDING (an entry, or a reservation held by slot)
                out[i] = MISS_SLOT
            elif fps[slot] != fp:
                out[i] = MISMATCH_SLOT
                mismatches += 1
            else:
                hits.append(slot)
        self.policy.touch_many(hits, part)
        if mismatches:
            self.counters["layout_mismatch"] += mismatches
        return out

    def pin(self, entry: ChunkEntry) -> None:
        """A LOOKUP lease: the chunk is not evicted until unpinned."""
        entry.pin_count += 1

    def unpin(self, entry: ChunkEntry) -> None:
        assert entry.pin_count > 0, "unpin without pin"
        entry.pin_count -= 1
        if not entry.pin_count:
            self.index.loosen(entry)

    def pick_victims(self, pages_needed: int, tenant: str | None = None
                     ) -> tuple[list[ChunkEntry], int]:
        """Coldest evictable chunks (READY, unleased, unread, not demoting) covering
        ``pages_needed`` pages, and the pages they hold; nothing when none are needed. With
        ``tenant``, only that tenant's chunks (a tenant over its quota evicts its own)."""
        slots, freed = self.victim_slots(pages_needed, tenant)
        return [self.index.entry(slot) for slot in slots], freed

    def victim_slots(self, pages_needed: int, tenant: str | None = None
                     ) -> tuple[list[int], int]:
        """``pick_victims`` as slots: no entry is built for a choice the caller may drop."""
        victims: list[int] = []
        freed = 0
        if pages_needed <= 0:
            return victims, freed
        index = self.index
        if tenant is None:
            slots = self.policy.victims()
        else:
            part = index.tenant_number(tenant)
            slots = self.policy.victims(part) if part >= 0 else iter(())
        active, pages_of, reads = index.active, index.pages_of, index.reads
        for slot in slots:
            entry = active.get(slot)
            if (entry is not None and not entry.evictable) or slot in reads:  # read by slot
                continue
            victims.append(slot)
            freed += pages_of(slot)
            if freed >= pages_needed:
                break
        return victims, freed

    def compact(self) -> int:
        """Fold idle entries back into columns (the daemon, once per loop iteration)."""
        return self.index.compact()
