"""Eviction policies behind a name registry (config key ``eviction_policy``)."""

from __future__ import annotations

from typing import Callable

from kvtierd.eviction.base import EvictionPolicy
from kvtierd.eviction.lru import LRUPolicy

POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRUPolicy}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; allowed: {', '.join(sorted(POLICIES))}"
        ) from None


__all__ = ["EvictionPolicy", "LRUPolicy", "POLICIES", "make_policy"]
