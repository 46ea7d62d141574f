"""The small parts of ``kvtierd.tiers.compact_index``: its slot flags, a key space's key dict,
and an interner.

Both exist so that a million chunks cost ints, not objects: a chunk names its key space and its
layout fingerprint by a small id, and its key bytes live in one dict per space.
"""

from __future__ import annotations

from typing import Iterator, Sequence

from kvtierd.tiers.columns import take_at

#: A slot's flags (``ChunkIndex._flags``).
USED, ACTIVE, ON_NVME, VERIFIED, MULTI = 1, 2, 4, 8, 16
SUMMED = 32  # the checksum column holds the chunk's checksum: folding it back need not write it
RESERVED = 64  # a PUT's reservation held by slot: PENDING, no entry (``ReservedSlots``)
CHECKSUM_BYTES = 16  # xxh3-128; an entry with another checksum length stays active

#: flags byte -> 1 where the slot is a reservation held by slot
_IS_RESERVED = bytes(1 if f & RESERVED else 0 for f in range(256))


class ReservedSlots:
    """``ChunkIndex.reserved``: the slots a PUT reserved by slot (``CpuTier.reserve_slots``), as a
    read-only set of slots over the index's flags column (the RESERVED bit) and its count.

    Why a flag and not a set: a PUT batch's slots went into a set at reservation and out of it at
    commit, each checked against it twice (~0.05 µs of the request loop per 16 KiB item), while
    the flags column is written at those very slots anyway; a batch check is now one read of the
    flags at its slots. The index sets and clears the bit (``add_pending``, ``commit_reserved``,
    ``entry``) and keeps the count."""

    __slots__ = ("_index",)

    def __init__(self, index) -> None:  # a ChunkIndex (its _flags column and _reserved_count)
        self._index = index

    def __len__(self) -> int:
        return self._index._reserved_count

    def __bool__(self) -> bool:
        return self._index._reserved_count > 0

    def __contains__(self, slot: int) -> bool:
        flags = self._index._flags
        return 0 <= slot < len(flags) and bool(flags[slot] & RESERVED)

    def __iter__(self) -> Iterator[int]:
        return (slot for slot, flag in enumerate(self._index._flags) if flag & RESERVED)

    def isdisjoint(self, slots: Sequence[int]) -> bool:
        """No slot of ``slots`` (slots of the index) is a reservation."""
        index = self._index
        return not index._reserved_count or 1 not in take_at(index._flags, slots).translate(
            _IS_RESERVED)

    def issuperset(self, slots: Sequence[int]) -> bool:
        """Every slot of ``slots`` (slots of the index) is a reservation."""
        return 0 not in take_at(self._index._flags, slots).translate(_IS_RESERVED)


class KeySpace:
    """One key space ``(tenant, namespace, rank)``: its keys and interned ids."""

    __slots__ = ("space", "id", "tenant", "keys")

    def __init__(self, space: tuple, sid: int, tenant: int) -> None:
        self.space = space
        self.id = sid
        self.tenant = tenant
        self.keys: dict[bytes, int] = {}


class Interner:
    """Values <-> small ints, refcounted so that ids of vanished values are reused."""

    def __init__(self) -> None:
        self.ids: dict = {}
        self.values: list = []
        self.refs: list[int] = []
        self._free: list[int] = []

    def take(self, value) -> int:
        i = self.ids.get(value)
        if i is None:
            if self._free:
                i = self._free.pop()
                self.values[i] = value
                self.refs[i] = 0
            else:
                i = len(self.values)
                self.values.append(value)
                self.refs.append(0)
            self.ids[value] = i
        self.refs[i] += 1
        return i

    def take_many(self, value, count: int) -> int:
        i = self.take(value)
        self.refs[i] += count - 1
        return i

    def release(self, i: int, count: int = 1) -> None:
        """Drop ``count`` references to id ``i`` (a batch of one value: one call)."""
        self.refs[i] -= count
        if not self.refs[i]:
            del self.ids[self.values[i]]
            self.values[i] = None
            self._free.append(i)
