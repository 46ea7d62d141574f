"""Exact least-recently-used order as an append-only log of slots.

Every ``insert``/``touch`` appends the slot to the log and stamps the slot with that position; a
log entry is live iff its slot's stamp is still its position, so a touch makes the older entry
garbage in O(1) without finding it. Victims are the live entries from the front. Each partition
(tenant with a quota; part -1 means none) has its own log of positions into the main one, so a
tenant at its quota finds its own coldest chunks in O(its victims), not O(all chunks colder than
them).

Garbage (superseded or removed entries) is dropped by rewriting the logs once it outweighs the
live entries twice over: amortised O(1) per touch. Memory: a 4-byte stamp per slot plus 4 bytes
per log entry in the main and the partition log, 12-28 bytes per chunk, and no per-key objects
(the OrderedDicts this replaces cost ~100 bytes per key, twice).

Positions are 32-bit: a rewrite renumbers them from 0 before they run out, so a tier may hold up
to ~1.4 billion chunks.
"""

from __future__ import annotations

from array import array
from itertools import compress
from typing import Iterable, Iterator

from kvtierd.eviction.base import EvictionPolicy

NONE = 0xFFFFFFFF  # stamp of a slot that is not in the policy
_LIMIT = 0xFFFFFFF0  # positions stay below this (a rewrite renumbers them first)
_SLACK = 65536  # garbage tolerated beyond twice the live entries before a rewrite


class LRUPolicy(EvictionPolicy):
    def __init__(self, slack: int = _SLACK) -> None:
        """``slack``: garbage entries tolerated beyond twice the live ones (small in tests, to
        make rewrites happen)."""
        self._slack = slack
        self._stamp = array("I")  # per slot: position of its live log entry, or NONE
        self._log = array("I")  # slots in access order, coldest first (plus garbage)
        self._head = 0  # every log entry before it is garbage
        self._parts: dict[int, array] = {}  # part -> positions in _log, in order
        self._part_heads: dict[int, int] = {}
        self._live = 0
        self.rewrites = 0

    def __len__(self) -> int:
        return self._live

    def __contains__(self, slot: int) -> bool:
        return slot < len(self._stamp) and self._stamp[slot] != NONE

    def insert(self, slot: int, part: int) -> None:
        stamp = self._stamp
        if slot >= len(stamp):
            stamp.extend(array("I", [NONE]) * (slot + 1 - len(stamp)))
        if stamp[slot] == NONE:
            self._live += 1
        self._append(slot, part)

    def touch(self, slot: int, part: int) -> None:
        if slot < len(self._stamp) and self._stamp[slot] != NONE:
            self._append(slot, part)

    def insert_many(self, slots: Iterable[int], part: int) -> None:
        """``insert`` of each slot in order; new slots past the end (recovery) in one go."""
        if not isinstance(slots, range) or slots.step != 1 or slots.start != len(self._stamp):
            super().insert_many(slots, part)
            return
        pos = len(self._log)
        self._stamp.extend(range(pos, pos + len(slots)))
        self._log.extend(slots)
        if part >= 0:
            plog = self._parts.get(part)
            if plog is None:
                plog = self._parts[part] = array("I")
                self._part_heads[part] = 0
            plog.extend(range(pos, pos + len(slots)))
        self._live += len(slots)
        if len(self._log) >= _LIMIT:
            self._rewrite()

    def touch_many(self, slots: list[int], part: int) -> None:
        """``touch`` of every slot in order (one batched LOOKUP's hits, all in ``part``)."""
        stamp, log = self._stamp, self._log
        pos = len(log)
        size = len(stamp)
        append = log.append
        if part < 0 and slots and max(slots) < size:
            first = pos
            for slot in slots:  # members (the common case): stamped here, logged in one go
                if stamp[slot] == NONE:
                    break
                stamp[slot] = pos
                pos += 1
            done = pos - first
            log.extend(slots[:done] if done < len(slots) else slots)
            for slot in slots[done:]:  # from the first non-member on, one by one
                if stamp[slot] != NONE:
                    stamp[slot] = pos
                    append(slot)
                    pos += 1
        elif part < 0:
            for slot in slots:
                if slot < size and stamp[slot] != NONE:
                    stamp[slot] = pos
                    append(slot)
                    pos += 1
        else:
            plog = self._parts.get(part)
            if plog is None:
                plog = self._parts[part] = array("I")
                self._part_heads[part] = 0
            part_append = plog.append
            for slot in slots:
                if slot < size and stamp[slot] != NONE:
                    stamp[slot] = pos
                    append(slot)
                    part_append(pos)
                    pos += 1
        if pos - self._head > 2 * self._live + self._slack or pos >= _LIMIT:
            self._rewrite()

    def _append(self, slot: int, part: int) -> None:
        log = self._log
        pos = len(log)
        self._stamp[slot] = pos
        log.append(slot)
        if part >= 0:
            plog = self._parts.get(part)
            if plog is None:
                plog = self._parts[part] = array("I")
                self._part_heads[part] = 0
            plog.append(pos)
        if pos - self._head > 2 * self._live + self._slack or pos >= _LIMIT:
            self._rewrite()

    def remove(self, slot: int) -> None:
        if slot < len(self._stamp) and self._stamp[slot] != NONE:
            self._stamp[slot] = NONE
            self._live -= 1

    def victims(self, part: int | None = None) -> Iterator[int]:
        stamp, log = self._stamp, self._log
        if part is None:
            pos, end = self._head, len(log)
            while pos < end and stamp[log[pos]] != pos:  # the garbage prefix goes for good
                pos += 1
            self._head = pos
            for pos in range(pos, end):
                slot = log[pos]
                if stamp[slot] == pos:
                    yield slot
            return
        plog = self._parts.get(part)
        if plog is None:
            return
        i, end = self._part_heads[part], len(plog)
        while i < end and stamp[log[plog[i]]] != plog[i]:
            i += 1
        self._part_heads[part] = i
        for i in range(i, end):
            pos = plog[i]
            slot = log[pos]
            if stamp[slot] == pos:
                yield slot

    def _rewrite(self) -> None:
        """Drop every garbage entry and renumber positions from 0, keeping the order. Live
        positions are marked from the stamps (one pass over the slots) and the log is filtered
        by that mask in C (``compress``) instead of a Python test per entry: the log holds up to
        three entries per live slot, and every LOOKUP hit adds one (the old one turns garbage)."""
        stamp, log, head = self._stamp, self._log, self._head
        live_mask = bytearray(len(log) - head)  # 1 where log[head + i] is live
        for pos in stamp:
            if pos != NONE:
                live_mask[pos - head] = 1
        live_parts: dict[int, list[int]] = {}
        for part, plog in self._parts.items():
            slots = [log[p] for p in plog[self._part_heads[part]:]
                     if p >= head and live_mask[p - head]]
            if slots:
                live_parts[part] = slots
        live = array("I", compress(log[head:], live_mask))
        for pos, slot in enumerate(live):
            stamp[slot] = pos
        self._log, self._head = live, 0
        self._parts = {part: array("I", [stamp[s] for s in slots])
                       for part, slots in live_parts.items()}
        self._part_heads = dict.fromkeys(self._parts, 0)
        self.rewrites += 1

    def check_invariants(self) -> None:
        stamp, log = self._stamp, self._log
        live = [s for s in range(len(stamp)) if stamp[s] != NONE]
        assert len(live) == self._live, f"LRU counts {self._live} slots, holds {len(live)}"
        for slot in live:
            pos = stamp[slot]
            assert self._head <= pos < len(log) and log[pos] == slot, f"slot {slot} lost its entry"
        seen: set[int] = set()
        for part, plog in self._parts.items():
            live_here = [log[pos] for pos in plog[self._part_heads[part]:] if stamp[log[pos]] == pos]
            assert not seen.intersection(live_here), "a slot is live in two partitions"
            seen.update(live_here)
        assert seen <= set(live), "a partition log holds a slot the main log does not"
