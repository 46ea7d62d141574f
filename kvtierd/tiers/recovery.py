"""Re-indexing a tier from its crash-safe index rows at start (warm arena, NVMe), when no
snapshot of a clean stop stands for them (``index_restore`` decides).

Fast enough for a node's index (target: 1M chunks to serving in <= 3 s): rows come from SQLite
in batches of 16k, three columns each (space id, key, the packed fixed fields: ``index_format``),
and each batch goes straight into the compact index's columns and the eviction policy in C-level
passes (``zip``, ``map``, ``join``, ``array`` slices and ``extend``), with no Python code and no
object per row beyond the key bytes the index keeps. The pages rows name are marked in a one-byte-per-page map, which finds
overlaps in C and yields the free extents without sorting a million runs. Cyclic GC is off while
loading: the batches' tuples hold no cycles, and gen-2 passes over a growing heap cost ~10 %.

Rows that cannot be right are dropped (the caller deletes them): runs outside the tier, a page
count that does not match the size, a space or fingerprint id that names none. Rows that
overlap each other mean the index cannot be trusted at all: ``allocator`` is None and the caller
starts cold.
"""

from __future__ import annotations

import collections
import gc
import itertools
import operator
import struct
from array import array
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from kvtierd.eviction.base import EvictionPolicy
from kvtierd.tiers.allocator import PageAllocator
from kvtierd.tiers.compact_index import CHECKSUM_BYTES, ChunkIndex
from kvtierd.tiers.index_db import ChunkIndexDB, Space, StoredKey, unpack_runs
from kvtierd.tiers.index_format import COMMON_CHECKSUM, decode_common, same, unpack

PROGRESS_EVERY = 100_000
# The bulk path hands a batch's packed checksums to the index's checksum column as they are.
assert COMMON_CHECKSUM == CHECKSUM_BYTES, (COMMON_CHECKSUM, CHECKSUM_BYTES)


@dataclass
class Loaded:
    allocator: PageAllocator | None  # None: rows overlap, nothing can be trusted
    overlap: str = ""
    bad: list[StoredKey] = field(default_factory=list)  # rows to delete (``delete_stored``)
    pages: int = 0  # pages of the chunks indexed
    tenant_pages: Counter[str] = field(default_factory=Counter)


class _Loader:
    """One recovery: rows in batches, each batch in one go (C-level ``zip``/``join``/``map``/
    ``extend`` over its columns); a batch with anything unusual (several runs per chunk, a bad
    row) takes the row-by-row path."""

    def __init__(self, index: ChunkIndex, policy: EvictionPolicy, part_of: Callable[[int], int],
                 num_pages: int, verified: bool, spaces: dict[int, Space],
                 fingerprints: dict[int, str]) -> None:
        self.index, self.policy, self.part_of = index, policy, part_of
        self.spaces, self.fingerprints = spaces, fingerprints
        self.num_pages, self.verified = num_pages, verified
        self.page_map = bytearray(num_pages)
        self.ones = memoryview(b"\1" * min(num_pages, 1 << 16))
        self.loaded = Loaded(None)

    def mark(self, start: int, count: int) -> bool:
        """Mark ``count`` pages from ``start`` used; False if one already was (overlap)."""
        page_map = self.page_map
        if count == 1:
            if page_map[start]:
                self.loaded.overlap = f"run ({start}, 1) overlaps another"
                return False
            page_map[start] = 1
            return True
        if page_map.find(1, start, start + count) >= 0:
            self.loaded.overlap = f"run ({start}, {count}) overlaps another"
            return False
        while count:
            step = min(count, len(self.ones))
            page_map[start:start + step] = self.ones[:step]
            start += step
            count -= step
        return True

    def batch(self, rows: list[tuple]) -> bool | None:
        """Index one batch of rows at once, every step a C-level pass over a column (no Python
        code per row unless the batch mixes tenants). None: not this way (the caller goes row
        by row); False: overlapping rows."""
        sids, keys, blobs = zip(*rows)
        n = len(keys)
        columns = decode_common(blobs)
        if columns is None:
            return None
        fids, sizes, starts, counts = columns.fp_ids, columns.nbytes, columns.starts, columns.counts
        space_ids, names = set(sids), self.spaces
        fid_set = {fids[0]} if same(fids) else set(fids)
        if not space_ids <= names.keys() or not fid_set <= self.fingerprints.keys():
            return None
        page_bytes = self.index.page_bytes
        pages_of = {size: max(1, -(-size // page_bytes))
                    for size in ((sizes[0],) if same(sizes) else set(sizes))}
        page_counts = set(pages_of.values())
        if (counts != array("Q", [page_counts.pop()]) * n if len(page_counts) == 1
                else array("Q", map(pages_of.__getitem__, sizes)) != counts):
            return None
        if counts[0] == 1 and same(counts):
            pages = n
            if max(starts) >= self.num_pages:
                return None
            # Overlaps here show at the end: fewer pages marked than indexed (``_load``).
            collections.deque(map(self.page_map.__setitem__, starts, itertools.repeat(1)),
                              maxlen=0)
        elif (max(map(operator.add, starts, counts)) > self.num_pages
              or not all(map(self.mark, starts, counts))):
            return None if not self.loaded.overlap else False
        else:
            pages = sum(counts)
        fps = ((self.fingerprints[fids[0]],) * n if len(fid_set) == 1
               else tuple(map(self.fingerprints.__getitem__, fids)))
        checksums = columns.checksums
        if len(space_ids) == 1:
            space = names[sids[0]]
            first = self.index.extend_compact(space, keys, fps, sizes, starts, checksums,
                                              verified=self.verified)
        else:
            spaces = list(map(names.__getitem__, sids))
            first = self.index.extend_compact_rows(spaces, keys, fps, sizes, starts, checksums,
                                                   verified=self.verified)
        slots = range(first, first + n)
        tenants = {names[sid][0] for sid in space_ids}
        if len(tenants) == 1:
            self.policy.insert_many(slots, self.part_of(first))
            self.loaded.tenant_pages[tenants.pop()] += pages
        else:
            tenant_pages = self.loaded.tenant_pages
            for slot, space, count in zip(slots, spaces, counts):
                self.policy.insert(slot, self.part_of(slot))
                tenant_pages[space[0]] += count
        self.loaded.pages += pages
        return True

    def row(self, sid: int, key: bytes, packed: bytes) -> bool:
        """Index one row (the slow path); False: it overlaps another."""
        try:
            fid, nbytes, checksum, blob = unpack(packed)
            runs = unpack_runs(blob)
        except (ValueError, struct.error):  # struct.error: not whole (start, count) pairs
            fid, nbytes, checksum, runs = -1, -1, b"", []
        space, fp = self.spaces.get(sid), self.fingerprints.get(fid)
        pages = 0
        fits = bool(runs)
        for start, count in runs:
            if count <= 0 or start < 0 or start + count > self.num_pages:
                fits = False
            pages += count
        if (not fits or space is None or fp is None or nbytes < 0
                or pages != max(1, -(-nbytes // self.index.page_bytes))):
            self.loaded.bad.append((sid, key))
            return True
        for start, count in runs:
            if not self.mark(start, count):
                return False
        slot = self.index.add_compact(space, key, fp, nbytes, checksum, runs,
                                      verified=self.verified)
        self.policy.insert(slot, self.part_of(slot))
        self.loaded.pages += pages
        self.loaded.tenant_pages[space[0]] += pages
        return True


def load_rows(db: ChunkIndexDB, index: ChunkIndex, policy: EvictionPolicy,
              part_of: Callable[[int], int], num_pages: int, *, verified: bool,
              progress: Callable[[int], None] | None = None) -> Loaded:
    """Index every row of ``db`` (READY, idle) into a fresh ``index`` and ``policy`` (partition
    ``part_of(slot)``): slots in row order, so the LRU order after a restart is the order rows
    were written (a row rewritten by ``INSERT OR REPLACE`` counts as written last)."""
    enabled = gc.isenabled()
    gc.disable()  # a million rows are a million tuples: no cycles, but gen-2 passes over them
    try:
        loader = _Loader(index, policy, part_of, num_pages, verified, db.space_names(),
                         db.fingerprint_names())
        return _load(db, loader, progress)
    finally:
        if enabled:
            gc.enable()


def _load(db: ChunkIndexDB, loader: _Loader, progress: Callable[[int], None] | None) -> Loaded:
    done = 0
    for batch in db.row_batches():
        fast = loader.batch(batch)
        if fast is False:
            return loader.loaded
        if fast is None and not all(loader.row(*row) for row in batch):
            return loader.loaded
        done += len(batch)
        if progress is not None and done // PROGRESS_EVERY != (done - len(batch)) // PROGRESS_EVERY:
            progress(done)
    if loader.page_map.count(1) != loader.loaded.pages:  # two one-page rows shared a page
        loader.loaded.overlap = "two rows name the same page"
        return loader.loaded
    loader.loaded.allocator = PageAllocator.from_page_map(loader.page_map)
    return loader.loaded
