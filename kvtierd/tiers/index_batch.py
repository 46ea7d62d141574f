"""``ChunkIndex``'s edits of a whole batch of chunks of one key space — a DELETE's removal of
plain compact chunks, a PUT's new reservations — as C-level loops over its columns: a column
read or written at the batch's slots in one call (``kvtierd.tiers.columns``), one ``translate`` of
the flags, one ``extend`` or ``update``.

Why: a DELETE of a batch that a PUT just stored removes thousands of idle chunks, and doing it
chunk by chunk (``_unindex`` per slot, each looking its key space, its fingerprint and its runs
up again) cost more per chunk than the old object index did (issue 12); a PUT's reservations
read each field back out of an entry object to store it. ``ChunkIndex`` mixes this in; the
columns it edits are ``ChunkIndex``'s (``kvtierd.tiers.compact_index`` says what each holds).
"""

from __future__ import annotations

from collections import deque
from itertools import repeat
from typing import Sequence

from kvtierd.tiers.columns import fill_at, put_at, put_records_at, same_at, take_at
from kvtierd.tiers.index_parts import (ACTIVE, CHECKSUM_BYTES, MULTI, RESERVED, SUMMED, USED,
                                       VERIFIED, KeySpace)

#: flags byte -> 1 where the slot is not a plain compact chunk (free, active, over several runs or
#: a reservation held by slot)
_NOT_PLAIN = bytes(1 if f & (ACTIVE | MULTI | RESERVED) or not f & USED else 0 for f in range(256))


class BatchEdits:
    """The batch half of ``ChunkIndex`` (``add`` and ``_unindex`` are its per-chunk form)."""

    def plain_slots(self, found: KeySpace, keys: Sequence[bytes], fp: int, take: bool = False
                    ) -> list[int] | None:
        """The slots of ``keys`` if every key is indexed in ``found`` once in the batch, and
        each chunk is *plain*: compact (so READY), one run, of the interned fingerprint ``fp``
        and not read by slot; None as soon as one is not (the caller then goes item by item).
        A DELETE of the batch a PUT stored finds exactly this. With ``take`` the keys leave
        ``found`` as they are read, one dict probe each instead of a lookup now and a deletion
        in ``discard_plain(taken=True)``, which the caller then owes them; a key repeated in the
        batch is missing at its second read, and a batch that is not plain gets its keys back."""
        slots = list(map(found.keys.pop if take else found.keys.get, keys, repeat(-1)))
        if take:
            if -1 in slots or not self._plain(slots, fp):
                found.keys.update([(key, slot) for key, slot in zip(keys, slots) if slot >= 0])
                return None
            return slots
        if -1 in slots or len(set(slots)) != len(slots) or not self._plain(slots, fp):
            return None
        return slots

    def _plain(self, slots: list[int], fp: int) -> bool:
        """Whether the chunks at ``slots`` (indexed, distinct) are plain (``plain_slots``)."""
        if 1 in take_at(self._flags, slots).translate(_NOT_PLAIN):
            return False  # (a reservation held by slot, PENDING, is not plain: its flags say so)
        if not self.fingerprint_covers_all(fp) and same_at(self._fp, slots) != fp:
            return False
        return not self.reads or self.reads.keys().isdisjoint(slots)

    def discard_plain(self, found: KeySpace, keys: Sequence[bytes], slots: list[int],
                      fp: int, taken: bool = False) -> tuple[list[int], list[int] | int, int]:
        """Unindex plain chunks (``plain_slots``: ``keys`` of ``found``, at ``slots``, of
        fingerprint id ``fp``; ``taken``: their keys already left ``found``): what ``_unindex``
        of each does. Returns their runs as first pages and page counts, in slot order (the
        counts one int where every chunk has the same size: ``PageAllocator.free_starts`` takes
        both forms), and the pages they hold."""
        page, starts = self.page_bytes, take_at(self._start, slots)
        size = same_at(self._nbytes, slots)
        counts: list[int] | int
        if size is not None:  # one chunk size (most batches)
            counts = -(-size // page) or 1
            total = counts * len(slots)
        else:
            counts = [-(-nbytes // page) or 1 for nbytes in take_at(self._nbytes, slots)]
            total = sum(counts)
        if not taken:
            deque(map(found.keys.__delitem__, keys), 0)  # every del in C; raises on a missing key
        fill_at(self._keys, slots, None)
        fill_at(self._flags, slots, 0)
        self._free_slots.extend(slots)
        self._count -= len(slots)
        self._fps.release(fp, len(slots))
        if not found.keys:
            del self._spaces[found.space]
            self._space_list[found.id] = None
            self._free_space_ids.append(found.id)
        return starts, counts, total

    def loosen_slots(self, slots: list[int]) -> None:
        """``loosen`` of the indexed entries at ``slots`` (a batch just committed)."""
        self._loose.update(slots)

    def add_pending(self, space: tuple, fingerprint: str, keys: Sequence[bytes],
                    sizes: Sequence[int], starts: Sequence[int], by_slot: bool = False
                    ) -> list[int]:
        """The columns of new one-run chunks of ``space`` (a PUT batch's reservations: ``keys``
        free and distinct, the caller has checked) with their first pages ``starts``; returns
        their slots, flagged ACTIVE, in order. The caller puts each chunk's entry into
        ``active`` at once (``CpuBatchOps._reserve_run``): ``add_many`` without reading the
        fields back out of entry objects, free slots taken as ``add`` takes them (last freed
        first) and new ones appended in C. ``by_slot``: the chunks stay reservations held by
        slot (flagged RESERVED, not ACTIVE: no entry) until ``commit_reserved``."""
        n = len(keys)
        if not n:
            return []
        found = self._spaces.get(space)
        if found is None:
            found = self._new_space(space)
        fp, sid, flag = (self._fps.take_many(fingerprint, n), found.id,
                         USED | RESERVED if by_slot else USED | ACTIVE)
        free = self._free_slots
        take = min(len(free), n)
        slots = free[:-take - 1:-1]  # what ``take`` pops would give, in that order
        if take:
            del free[-take:]
        spaces, fps, lengths, firsts = self._space, self._fp, self._nbytes, self._start
        names, flags = self._keys, self._flags
        if take:  # each column written at the reused slots in one call (the first take values)
            fill_at(spaces, slots, sid)
            fill_at(fps, slots, fp)
            put_at(lengths, slots, sizes)
            put_at(firsts, slots, starts)
            put_at(names, slots, keys)
            fill_at(flags, slots, flag)
        if take < n:
            new = n - take
            slots.extend(range(len(names), len(names) + new))
            spaces.extend(repeat(sid, new))
            fps.extend(repeat(fp, new))
            lengths.extend(sizes[take:])
            firsts.extend(starts[take:])
            names.extend(keys[take:])
            flags.extend(bytes([flag]) * new)
            self._sum.extend(bytes(CHECKSUM_BYTES * new))
        before = len(found.keys)
        found.keys.update(zip(keys, slots))
        assert len(found.keys) == before + n, "add_pending of a key that is indexed or repeated"
        self._count += n
        if by_slot:
            self._reserved_count += n
        return slots

    def commit_reserved(self, slots: list[int], checksums: Sequence[bytes]) -> None:
        """Reservations held by slot (every one still in ``reserved``: its caller,
        ``CpuTier.commit_slots``, has just checked, and ``check_invariants`` holds the count to
        the flags), committed with their ``checksums`` (CHECKSUM_BYTES each): straight into
        compact READY form, verified (what ``fold`` of their committed entries would leave), with
        no entry built."""
        put_records_at(self._sum, slots, checksums, CHECKSUM_BYTES)
        fill_at(self._flags, slots, USED | SUMMED | VERIFIED)  # RESERVED cleared
        self._reserved_count -= len(slots)
