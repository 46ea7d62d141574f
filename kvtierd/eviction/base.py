"""The eviction seam: which evictable chunk goes first.

A policy only orders keys; the tier decides what is evictable (READY, not leased, not being read)
and tells the policy about every change:

* ``insert(key)`` when a chunk becomes READY,
* ``touch(key)`` on every hit,
* ``remove(key)`` when a chunk leaves the tier for any reason,
* ``victims()`` yields keys in eviction order; the tier skips the ones it cannot evict now.
"""

from __future__ import annotations

import abc
from typing import Hashable, Iterator


class EvictionPolicy(abc.ABC):
    @abc.abstractmethod
    def insert(self, key: Hashable) -> None: ...

    @abc.abstractmethod
    def touch(self, key: Hashable) -> None: ...

    @abc.abstractmethod
    def remove(self, key: Hashable) -> None: ...

    @abc.abstractmethod
    def victims(self) -> Iterator[Hashable]:
        """Keys from first to last to evict, lazily: the caller collects what it needs and
        only then calls remove() (no changes to the policy while iterating)."""

    @abc.abstractmethod
    def __len__(self) -> int: ...
