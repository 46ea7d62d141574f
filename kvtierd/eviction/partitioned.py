"""One policy over all keys plus one per partition (a tenant), kept in step.

A tenant over its quota evicts its own coldest chunks. Scanning the shared order for them would
walk past every other tenant's colder chunks on each reservation (O(chunks) per PUT item while a
tenant sits at its quota); a policy per partition answers in the order of the shared policy's kind
at the cost of a second entry per key.
"""

from __future__ import annotations

from typing import Callable, Hashable, Iterator

from kvtierd.eviction.base import EvictionPolicy


class PartitionedPolicy(EvictionPolicy):
    def __init__(self, make: Callable[[], EvictionPolicy],
                 part: Callable[[Hashable], Hashable]) -> None:
        self._make = make
        self._part = part
        self._all = make()
        self._parts: dict[Hashable, EvictionPolicy] = {}

    def insert(self, key: Hashable) -> None:
        self._all.insert(key)
        part = self._part(key)
        policy = self._parts.get(part)
        if policy is None:
            policy = self._parts[part] = self._make()
        policy.insert(key)

    def touch(self, key: Hashable) -> None:
        self._all.touch(key)
        policy = self._parts.get(self._part(key))
        if policy is not None:
            policy.touch(key)

    def remove(self, key: Hashable) -> None:
        self._all.remove(key)
        part = self._part(key)
        policy = self._parts.get(part)
        if policy is not None:
            policy.remove(key)
            if not len(policy):
                del self._parts[part]

    def victims(self) -> Iterator[Hashable]:
        return self._all.victims()

    def victims_of(self, part: Hashable) -> Iterator[Hashable]:
        """Keys of one partition only, in eviction order."""
        policy = self._parts.get(part)
        return policy.victims() if policy is not None else iter(())

    def __len__(self) -> int:
        return len(self._all)

    def check_invariants(self) -> None:
        total = 0
        for part, policy in self._parts.items():
            assert len(policy), f"empty partition {part!r} kept"
            assert all(self._part(k) == part for k in policy.victims()), "key in another partition"
            total += len(policy)
        assert total == len(self._all), "partitions and the shared policy disagree"
