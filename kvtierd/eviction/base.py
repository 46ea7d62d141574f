"""The eviction seam: in which order a tier's evictable chunks go.

A policy orders the *slots* of one tier's index (``kvtierd.tiers.compact_index``): small ints, one
per indexed chunk, each in a partition (its tenant's id), so that a tenant over its quota finds its
own coldest chunks without walking past every other tenant's. The policy only orders; the tier
decides what is evictable (READY, not leased, not being read) and tells the policy every change:

* ``insert(slot, part)`` when a chunk becomes a candidate (READY, not on its way out),
* ``touch(slot, part)`` on every hit (``part`` is the one it was inserted with),
* ``remove(slot)`` when it stops being one, for any reason (``remove_many``: of a batch),
* ``victims(part=None)`` yields slots in eviction order, lazily; the tier skips the ones it cannot
  evict now. The caller collects what it needs and only then calls ``remove`` (no changes to the
  policy while iterating).

No per-chunk objects: a policy keeps its state in ``array`` slabs indexed by slot, because a tier
indexes millions of chunks and every Python object costs tens of bytes (issue 12).
"""

from __future__ import annotations

import abc
from typing import Iterable, Iterator


class EvictionPolicy(abc.ABC):
    @abc.abstractmethod
    def insert(self, slot: int, part: int) -> None: ...

    @abc.abstractmethod
    def touch(self, slot: int, part: int) -> None: ...

    def insert_many(self, slots: Iterable[int], part: int) -> None:
        """``insert`` of each slot in order (recovery)."""
        for slot in slots:
            self.insert(slot, part)

    def touch_many(self, slots: list[int], part: int) -> None:
        """``touch`` of each slot in order (a policy may do it faster in one go)."""
        for slot in slots:
            self.touch(slot, part)

    @abc.abstractmethod
    def remove(self, slot: int) -> None: ...

    def remove_many(self, slots: Iterable[int]) -> None:
        """``remove`` of each slot (a DELETE batch; a policy may do it faster in one go)."""
        for slot in slots:
            self.remove(slot)

    @abc.abstractmethod
    def victims(self, part: int | None = None) -> Iterator[int]:
        """Slots (of ``part`` only, if given) from first to last to evict, lazily."""

    @abc.abstractmethod
    def __contains__(self, slot: int) -> bool: ...

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def check_invariants(self) -> None: ...
