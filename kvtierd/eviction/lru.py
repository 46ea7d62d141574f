"""Exact least-recently-used order as an append-only log of slots.

Every ``insert``/``touch`` appends the slot to the log and stamps the slot with that position; a
log entry is live iff its slot's stamp is still its position, so a touch makes the older entry
garbage in O(1) without finding it. Victims are the live entries from the front. Each partition
(tenant with a quota; part -1 means none) has its own log of positions into the main one, so a
tenant at its quota finds its own coldest chunks in O(its victims), not O(all chunks colder than
them).

Garbage (superseded or removed entries) is dropped by rewriting the logs once it outweighs the
live entries three times over: amortised O(1) per touch. Memory: a 4-byte stamp and a membership
byte per slot plus 4 bytes per log entry in the main and the partition log (one per live slot
right after a rewrite or a restart, at most four plus the slack before the next), 9-37 bytes per
chunk, and no per-key objects (the OrderedDicts this replaces cost ~100 bytes per key, twice).

Why batched touches and the rewrite look the way they do: a 1024-key LOOKUP of a 1M-chunk tier
touches every hit, and py-spy showed the touches and the rewrites they cause at a third of the
handler (issue 12). So a batch stamps its members in one tight loop (membership read from a
bytearray: no int object built per test, as reading a 32-bit stamp builds one), logs them with
one ``extend`` (and the partition log with one ``range``), and a rewrite is a few C loops over
the slabs (``_stamps``: as Python passes, which read every element as an int object, it took
~0.2 s of the request loop at a million chunks on the 2-core test machine); tolerating three
times the live entries as garbage instead of once makes it run a third as often, for at most 8
more bytes a chunk between rewrites.

Positions are 32-bit: a rewrite renumbers them from 0 before they run out, so a tier may hold up
to ~1.4 billion chunks.
"""

from __future__ import annotations

from array import array
from typing import Iterable, Iterator

from kvtierd.eviction.base import EvictionPolicy

NONE = 0xFFFFFFFF  # stamp of a slot that is not in the policy
_LIMIT = 0xFFFFFFF0  # positions stay below this (a rewrite renumbers them first)
_SLACK = 65536  # garbage tolerated beyond _GARBAGE times the live entries before a rewrite
_GARBAGE = 3  # garbage tolerated per live entry (plus the slack) before a rewrite


def stamp_members_python(stamp: array, member: bytearray, slots: list[int], start: int) -> int:
    """``stamp[slots[i]] = start + i`` for the leading slots that are members; how many."""
    pos = start
    try:
        for slot in slots:
            if not member[slot]:
                break
            stamp[slot] = pos
            pos += 1
    except IndexError:  # past the end: not a member
        pass
    return pos - start


def stamp_inserted_python(stamp: array, member: bytearray, slots: list[int], start: int) -> int:
    """Every slot a member, stamped ``start + i`` (a slot twice: the later position wins, as two
    inserts leave it); how many were not members before."""
    new = 0
    for pos, slot in enumerate(slots, start):
        if not member[slot]:
            member[slot] = 1
            new += 1
        stamp[slot] = pos
    return new


def unstamp_members_python(stamp: array, member: bytearray, slots: list[int], none: int) -> int:
    """Each slot that is a member no longer one (stamp ``none``); how many were."""
    size = len(member)
    removed = 0
    for slot in slots:
        if slot < size and member[slot]:
            stamp[slot] = none
            member[slot] = 0
            removed += 1
    return removed


def live_entries_python(log: array, stamp: array, positions: array | None, head: int) -> bytes:
    """The live entries of ``log`` as 32-bit slots: ``log[pos]`` for each ``pos >= head`` (or,
    with ``positions``, each position in ``positions[head:]``) whose slot is stamped ``pos``."""
    nlog, nstamp = len(log), len(stamp)
    at = range(head, nlog) if positions is None else positions[head:]
    kept = array("I")
    for pos in at:
        if pos < nlog:
            slot = log[pos]
            if slot < nstamp and stamp[slot] == pos:
                kept.append(slot)
    return kept.tobytes()


def renumber_python(stamp: array, slots: array) -> None:
    """``stamp[slots[i]] = i`` for every i; a slot out of range writes nothing."""
    for i, slot in enumerate(slots):
        if slot >= len(stamp):
            raise IndexError(f"slots[{i}] is {slot}; the policy has {len(stamp)} slots")
    for i, slot in enumerate(slots):
        stamp[slot] = i


def stamps_at_python(stamp: array, slots: array) -> bytes:
    """``stamp[slot]`` for every slot, as 32-bit values."""
    return array("I", map(stamp.__getitem__, slots)).tobytes()


try:  # the same loops compiled (setup.py; optional): a batch's stamps in one call
    from kvtierd.eviction._stamps import (live_entries, renumber, stamp_inserted, stamp_members,
                                          stamps_at, unstamp_members)
    NATIVE = "compiled"
except ImportError:
    stamp_members, stamp_inserted = stamp_members_python, stamp_inserted_python
    unstamp_members = unstamp_members_python
    live_entries, renumber, stamps_at = live_entries_python, renumber_python, stamps_at_python
    NATIVE = "python"


def _u32(raw: bytes) -> array:
    column = array("I")
    column.frombytes(raw)
    return column


class LRUPolicy(EvictionPolicy):
    def __init__(self, slack: int = _SLACK) -> None:
        """``slack``: garbage entries tolerated beyond ``_GARBAGE`` times the live ones (small
        in tests, to make rewrites happen)."""
        self._slack = slack
        self._stamp = array("I")  # per slot: position of its live log entry, or NONE
        self._member = bytearray()  # per slot: 1 iff its stamp is not NONE (cheap to test)
        self._log = array("I")  # slots in access order, coldest first (plus garbage)
        self._head = 0  # every log entry before it is garbage
        self._parts: dict[int, array] = {}  # part -> positions in _log, in order
        self._part_heads: dict[int, int] = {}
        self._live = 0
        self.rewrites = 0

    def __len__(self) -> int:
        return self._live

    def __contains__(self, slot: int) -> bool:
        return slot < len(self._member) and self._member[slot] == 1

    def insert(self, slot: int, part: int) -> None:
        stamp = self._stamp
        if slot >= len(stamp):
            grow = slot + 1 - len(stamp)
            stamp.extend(array("I", [NONE]) * grow)
            self._member.extend(bytes(grow))
        if not self._member[slot]:
            self._member[slot] = 1
            self._live += 1
        self._append(slot, part)

    def touch(self, slot: int, part: int) -> None:
        if slot < len(self._member) and self._member[slot]:
            self._append(slot, part)

    def insert_many(self, slots: Iterable[int], part: int) -> None:
        """``insert`` of each slot in order; new slots past the end (recovery) in one go, any
        other list (a PUT batch's commits) stamped in one loop and logged in one ``extend``."""
        if not isinstance(slots, range) or slots.step != 1 or slots.start != len(self._stamp):
            self._insert_list(list(slots), part)
            return
        pos = len(self._log)
        self._stamp.extend(range(pos, pos + len(slots)))
        self._member.extend(b"\1" * len(slots))
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

    def _insert_list(self, slots: list[int], part: int) -> None:
        if not slots:
            return
        if len(self._log) + len(slots) >= _LIMIT:  # positions would run out mid-batch
            super().insert_many(slots, part)
            return
        stamp, member, log = self._stamp, self._member, self._log
        top = max(slots)
        if top >= len(stamp):
            grow = top + 1 - len(stamp)
            stamp.extend(array("I", [NONE]) * grow)
            member.extend(bytes(grow))
        start = len(log)
        self._live += stamp_inserted(stamp, member, slots, start)
        log.extend(slots)
        self._logged(part, start, start + len(slots))

    def touch_many(self, slots: list[int], part: int) -> None:
        """``touch`` of every slot in order (one batched LOOKUP's hits, all in ``part``). The
        leading members (all of them, in the common case) are stamped in one loop and logged in
        one go; from the first non-member on (removed, never inserted, past the end) slot by
        slot. A slot twice in the batch is stamped twice, the later position winning, as two
        touches leave it."""
        stamp, member, log = self._stamp, self._member, self._log
        pos = start = len(log)
        done = stamp_members(stamp, member, slots, start)
        pos += done
        log.extend(slots if done == len(slots) else slots[:done])
        if done < len(slots):
            size, append = len(member), log.append
            for slot in slots[done:]:
                if slot < size and member[slot]:
                    stamp[slot] = pos
                    append(slot)
                    pos += 1
        self._logged(part, start, pos)

    def _logged(self, part: int, start: int, pos: int) -> None:
        """A batch took log positions ``start..pos``: they go into ``part``'s log too, and the
        log is rewritten once its garbage outgrows the live entries."""
        if part >= 0 and pos > start:
            plog = self._parts.get(part)
            if plog is None:
                plog = self._parts[part] = array("I")
                self._part_heads[part] = 0
            plog.extend(range(start, pos))
        if pos - self._head > (1 + _GARBAGE) * self._live + self._slack or pos >= _LIMIT:
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
        if pos - self._head > (1 + _GARBAGE) * self._live + self._slack or pos >= _LIMIT:
            self._rewrite()

    def remove(self, slot: int) -> None:
        if slot < len(self._member) and self._member[slot]:
            self._stamp[slot] = NONE
            self._member[slot] = 0
            self._live -= 1

    def remove_many(self, slots: Iterable[int]) -> None:
        """``remove`` of each slot, in one loop (their log entries turn garbage, as one by one)."""
        self._live -= unstamp_members(self._stamp, self._member, list(slots), NONE)

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
        """Drop every garbage entry and renumber positions from 0, keeping the order: each
        partition's live entries (read through the old stamps), then the main log's, are kept in
        one loop each (``live_entries``), the stamps renumbered in one (``renumber``) and each
        partition's positions read back from them (``stamps_at``). The log holds up to four
        entries per live slot, and every LOOKUP hit adds one (the old one turns garbage)."""
        stamp, log = self._stamp, self._log
        live_parts: dict[int, array] = {}
        for part, plog in self._parts.items():
            slots = _u32(live_entries(log, stamp, plog, self._part_heads[part]))
            if slots:
                live_parts[part] = slots
        live = _u32(live_entries(log, stamp, None, self._head))
        renumber(stamp, live)
        self._log, self._head = live, 0
        self._parts = {part: _u32(stamps_at(stamp, slots)) for part, slots in live_parts.items()}
        self._part_heads = dict.fromkeys(self._parts, 0)
        self.rewrites += 1

    def check_invariants(self) -> None:
        stamp, log = self._stamp, self._log
        live = [s for s in range(len(stamp)) if stamp[s] != NONE]
        assert len(live) == self._live, f"LRU counts {self._live} slots, holds {len(live)}"
        assert len(self._member) == len(stamp) and [
            s for s in range(len(stamp)) if self._member[s]] == live, "membership bytes drifted"
        for slot in live:
            pos = stamp[slot]
            assert self._head <= pos < len(log) and log[pos] == slot, f"slot {slot} lost its entry"
        seen: set[int] = set()
        for part, plog in self._parts.items():
            live_here = [log[pos] for pos in plog[self._part_heads[part]:] if stamp[log[pos]] == pos]
            assert not seen.intersection(live_here), "a slot is live in two partitions"
            seen.update(live_here)
        assert seen <= set(live), "a partition log holds a slot the main log does not"
