"""Page-granular allocation of a tier as runs of contiguous pages.

A chunk needs ``ceil(nbytes / page_bytes)`` pages that need not be contiguous: the allocator hands
out as few runs as it can (first fit of one run, else the largest free runs), and copies move one
run at a time, so fragmentation costs a few extra memcpy calls, never a failed PUT while free pages
remain. Allocation returns ``None`` when not enough pages are free; the caller evicts and retries.
"""

from __future__ import annotations

import bisect
from itertools import repeat
from operator import sub
from typing import Sequence

Run = tuple[int, int]  # (first page, page count)


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self.free_pages = num_pages
        # Free extents sorted by first page, never adjacent (free() coalesces).
        self._starts: list[int] = [0]
        self._lengths: list[int] = [num_pages]

    @classmethod
    def from_used(cls, num_pages: int, used: list[Run]) -> PageAllocator:
        """An allocator whose free pages are the gaps between ``used`` runs (recovery)."""
        alloc = cls(num_pages)
        alloc._starts, alloc._lengths = [], []
        end = 0
        for start, count in sorted(used):
            if start < end or count <= 0 or start + count > num_pages:
                raise ValueError(f"run ({start}, {count}) overlaps another or is out of range")
            if start > end:
                alloc._starts.append(end)
                alloc._lengths.append(start - end)
            end = start + count
        if end < num_pages:
            alloc._starts.append(end)
            alloc._lengths.append(num_pages - end)
        alloc.free_pages = sum(alloc._lengths)
        return alloc

    @classmethod
    def from_page_map(cls, used: bytearray) -> PageAllocator:
        """An allocator over ``len(used)`` pages whose free pages are the zero bytes of ``used``
        (one byte per page, built by recovery: C-speed scans instead of sorting every run)."""
        alloc = cls(len(used))
        alloc._starts, alloc._lengths = [], []
        total = len(used)
        pos = used.find(0)
        while pos >= 0:
            end = used.find(1, pos)
            if end < 0:
                end = total
            alloc._starts.append(pos)
            alloc._lengths.append(end - pos)
            pos = used.find(0, end) if end < total else -1
        alloc.free_pages = sum(alloc._lengths)
        return alloc

    def allocate(self, count: int) -> list[Run] | None:
        if count <= 0:
            raise ValueError(f"page count must be positive, got {count}")
        if count > self.free_pages:
            return None
        for i, length in enumerate(self._lengths):
            if length >= count:
                return [self._take(i, count)]
        runs: list[Run] = []
        need = count
        while need:
            i = max(range(len(self._lengths)), key=self._lengths.__getitem__)
            take = min(need, self._lengths[i])
            runs.append(self._take(i, take))
            need -= take
        return runs

    def allocate_run(self, count: int) -> Run | None:
        """``count`` pages as one run (first fit), or None when no free extent holds them."""
        if count <= 0:
            raise ValueError(f"page count must be positive, got {count}")
        if count <= self.free_pages:
            for i, length in enumerate(self._lengths):
                if length >= count:
                    return self._take(i, count)
        return None

    def allocate_many(self, count: int, n: int) -> list[Run]:
        """Up to ``n`` runs of exactly ``count`` pages: what ``n`` calls of ``allocate(count)``
        hand out while each still finds one run (first fit), in one pass over the extents. Fewer
        when the extents run out of ``count``-page room: the caller allocates the rest one by one
        (those may need several runs, or eviction)."""
        return list(zip(self.allocate_starts(count, n), repeat(count)))

    def allocate_starts(self, count: int, n: int) -> list[int]:
        """``allocate_many`` as the runs' first pages alone (each run is ``count`` pages)."""
        out: list[int] = []
        for first, runs in self.allocate_extents(count, n):
            out.extend(range(first, first + runs * count, count))
        return out

    def allocate_extents(self, count: int, n: int) -> list[tuple[int, int]]:
        """``allocate_many`` as the stretches it cut them from: ``(first page, runs)`` for each
        stretch of ``runs`` runs of ``count`` pages side by side, in order (one stretch for most
        batches): a PUT batch's reservations build their first pages and arena offsets from
        these with a ``range`` each, no int computed per chunk in Python."""
        if count <= 0:
            raise ValueError(f"page count must be positive, got {count}")
        starts, lengths = self._starts, self._lengths
        out: list[tuple[int, int]] = []
        placed = 0
        i = 0
        while placed < n and i < len(lengths):
            length = lengths[i]
            if length < count:
                i += 1
                continue
            take = min(n - placed, length // count)
            start, used = starts[i], take * count
            out.append((start, take))
            placed += take
            if used == length:
                del starts[i], lengths[i]
            else:
                starts[i] += used
                lengths[i] -= used
                i += 1  # what is left is shorter than count, or n runs are out
            self.free_pages -= used
        return out

    def _take(self, i: int, count: int) -> Run:
        start = self._starts[i]
        if self._lengths[i] == count:
            del self._starts[i], self._lengths[i]
        else:
            self._starts[i] += count
            self._lengths[i] -= count
        self.free_pages -= count
        return (start, count)

    def free(self, runs: list[Run]) -> None:
        """Return ``runs`` to the free extents: all of them, or (a double free, a run out of
        range) none, with ``ValueError`` naming the run."""
        if len(runs) == 1:
            self._free_run(*runs[0])
        else:
            self.free_many(runs)

    def free_many(self, runs: list[Run]) -> None:
        """``free`` of many runs (a DELETE batch): sorted, and runs that touch merged first, so
        that the extents are searched and edited once per merged run instead of once per run
        (a batch a PUT placed side by side frees as one run). The same checks as ``free``, all
        made before any page is freed: a batch with one bad run frees nothing."""
        if not runs:
            return
        runs = sorted(runs)
        merged: list[Run] = []
        first, end = runs[0][0], runs[0][0]
        for start, count in runs:
            if count <= 0:
                raise ValueError(f"run ({start}, {count}) is outside 0..{self.num_pages}")
            if start < end:  # overlaps the run before it
                raise ValueError(f"double free of pages ({start}, {count})")
            if start != end:
                merged.append((first, end - first))
                first = end = start
            end += count
        merged.append((first, end - first))
        for start, count in merged:  # disjoint: each is checked against the extents as they are
            self._free_slot(start, count)
        for start, count in merged:
            self._free_run(start, count)

    def free_starts(self, starts: Sequence[int], counts: Sequence[int] | int) -> None:
        """``free_many`` of the runs ``zip(starts, counts)``; ``counts`` one int where every run
        has that many pages (a DELETE of one chunk size). Then runs of the batch that overlap
        one another are refused before any page is freed, and a batch a PUT placed side by side
        (the runs touch one another end to start) goes back as one run, with no tuple per
        chunk."""
        if not isinstance(counts, int):
            self.free_many(list(zip(starts, counts)))
            return
        if not starts:
            return
        if counts <= 0:
            raise ValueError(f"run ({starts[0]}, {counts}) is outside 0..{self.num_pages}")
        ordered = sorted(starts)
        first, n = ordered[0], len(ordered)
        if ordered == list(range(first, first + n * counts, counts)):  # side by side: one run
            self._free_run(first, n * counts)
            return
        if n > 1:
            gaps = list(map(sub, ordered[1:], ordered))
            if min(gaps) < counts:  # two runs of the batch overlap: refused before any is freed
                at = next(i for i, gap in enumerate(gaps) if gap < counts) + 1
                raise ValueError(f"double free of pages ({ordered[at]}, {counts})")
        self.free_many(list(zip(ordered, repeat(counts))))

    def _free_slot(self, start: int, count: int) -> tuple[int, int]:
        """Where the run ``(start, count)`` goes among the free extents: the index of the first
        extent after it and the end of the one before it (-1 if none); ``ValueError`` if the run
        is out of range or overlaps a free extent (a double free)."""
        if count <= 0 or start < 0 or start + count > self.num_pages:
            raise ValueError(f"run ({start}, {count}) is outside 0..{self.num_pages}")
        i = bisect.bisect_left(self._starts, start)
        prev_end = self._starts[i - 1] + self._lengths[i - 1] if i else -1
        if prev_end > start or (i < len(self._starts) and self._starts[i] < start + count):
            raise ValueError(f"double free of pages ({start}, {count})")
        return i, prev_end

    def _free_run(self, start: int, count: int) -> None:
        i, prev_end = self._free_slot(start, count)
        merge_prev = prev_end == start
        merge_next = i < len(self._starts) and self._starts[i] == start + count
        if merge_prev and merge_next:
            self._lengths[i - 1] += count + self._lengths[i]
            del self._starts[i], self._lengths[i]
        elif merge_prev:
            self._lengths[i - 1] += count
        elif merge_next:
            self._starts[i] = start
            self._lengths[i] += count
        else:
            self._starts.insert(i, start)
            self._lengths.insert(i, count)
        self.free_pages += count

    def free_runs(self) -> list[Run]:
        return list(zip(self._starts, self._lengths))

    def check_invariants(self) -> None:
        total = 0
        end = -1
        for start, length in self.free_runs():
            assert length > 0, f"empty free extent at {start}"
            assert start > end, f"free extents overlap or touch at {start}"
            end = start + length
            total += length
        assert end <= self.num_pages, f"free extent past the end: {end} > {self.num_pages}"
        assert total == self.free_pages, f"free count {self.free_pages} != extents {total}"


def trim_runs(runs: list[Run], pages: int) -> tuple[list[Run], list[Run]]:
    """``runs`` cut after their first ``pages`` pages: (the kept runs, the spare ones)."""
    kept: list[Run] = []
    spare: list[Run] = []
    left = pages
    for start, count in runs:
        if left >= count:
            kept.append((start, count))
        elif left > 0:
            kept.append((start, left))
            spare.append((start + left, count - left))
        else:
            spare.append((start, count))
        left -= count
    return kept, spare
