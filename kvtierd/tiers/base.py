"""What every tier's index does alike: find a READY chunk for a reader of one layout."""

from __future__ import annotations

from collections import Counter
from typing import Hashable

from kvtierd.eviction.base import EvictionPolicy
from kvtierd.protocol import Status
from kvtierd.tiers.chunk import ChunkEntry, ChunkState


class TierIndex:
    """Mixin: needs ``index``, ``policy`` and ``counters`` on the tier."""

    index: dict[Hashable, ChunkEntry]
    policy: EvictionPolicy
    counters: Counter[str]

    def lookup(self, ikey: Hashable, fingerprint: str) -> tuple[Status, ChunkEntry | None]:
        """The READY chunk under ``ikey`` (touched for the eviction policy), a MISS, or
        LAYOUT_MISMATCH when it was written by another layout: never bytes for the wrong reader."""
        entry = self.index.get(ikey)
        if entry is None or entry.state is not ChunkState.READY:
            return Status.MISS, None
        if entry.fingerprint != fingerprint:
            self.counters["layout_mismatch"] += 1
            return Status.LAYOUT_MISMATCH, None
        self.policy.touch(ikey)
        return Status.OK, entry

    def pick_victims(self, pages_needed: int, tenant: str | None = None
                     ) -> tuple[list[ChunkEntry], int]:
        """Coldest evictable chunks (READY, unleased, unread, not demoting) covering
        ``pages_needed`` pages, and the pages they hold; nothing when none are needed. With
        ``tenant``, only that tenant's chunks (a tenant over its quota evicts its own)."""
        victims: list[ChunkEntry] = []
        freed = 0
        if pages_needed <= 0:
            return victims, freed
        # Only a tier with a partitioned policy (the CPU tier) is asked for one tenant's victims.
        keys = self.policy.victims() if tenant is None else self.policy.victims_of(tenant)
        for ikey in keys:
            entry = self.index[ikey]
            if not entry.evictable:
                continue
            victims.append(entry)
            freed += entry.pages
            if freed >= pages_needed:
                break
        return victims, freed
