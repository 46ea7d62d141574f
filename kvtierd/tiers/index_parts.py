"""The small parts of ``kvtierd.tiers.compact_index``: its slot flags, a key space's key dict,
and an interner.

Both exist so that a million chunks cost ints, not objects: a chunk names its key space and its
layout fingerprint by a small id, and its key bytes live in one dict per space.
"""

from __future__ import annotations

#: A slot's flags (``ChunkIndex._flags``).
USED, ACTIVE, ON_NVME, VERIFIED, MULTI = 1, 2, 4, 8, 16
SUMMED = 32  # the checksum column holds the chunk's checksum: folding it back need not write it
CHECKSUM_BYTES = 16  # xxh3-128; an entry with another checksum length stays active


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
