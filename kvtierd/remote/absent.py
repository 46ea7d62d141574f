"""The remote tier's "found absent" cache: keys an existence check did not find, trusted for a TTL.

An engine asks about the same missing prefix every step; without this cache every LOOKUP would
ask the store again. A key is in the cache (``in``) from the check that found it absent until that
check's expiry, at most ``bound`` keys (the oldest checks' keys out first), and leaves it when
found or written here (``discard``).

Why not one ``OrderedDict`` key → expiry (the first version): a check records up to 1024 keys at
once, and moving each to the end (``pop`` + set) cost more than half of Mooncake's own
``batch_is_exist`` for them (benchmarks/remote_tier.py). Here a check is one ``dict.update`` (a C
loop) and one entry in a queue of checks, ``(number, expiry, keys)``, which is the expiry order. A
key found absent again before its expiry sits in two checks of the queue: the ``dict`` holds the
number of its latest check, and the older check's entry for it is stale (another number), ignored
when that check leaves the queue. Numbers, not expiries: two checks may share an expiry.
"""

from __future__ import annotations

from collections import deque
from itertools import repeat
from typing import Hashable, Sequence


class AbsentCache:
    """Keys found absent, by the check that found them; see the module docstring."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.check_of: dict[Hashable, int] = {}  # key → the number of its latest check
        self._checks: deque[tuple[int, float, Sequence[Hashable]]] = deque()  # expiry order
        self._numbered = 0

    def __contains__(self, key: Hashable) -> bool:
        return key in self.check_of

    def __len__(self) -> int:
        return len(self.check_of)

    def add(self, keys: Sequence[Hashable], expiry: float, now: float) -> None:
        """Record one check's absent ``keys`` until ``expiry`` (no earlier than any earlier
        add's: the queue stays in expiry order)."""
        self.prune(now)
        self._numbered += 1
        self.check_of.update(zip(keys, repeat(self._numbered)))
        self._checks.append((self._numbered, expiry, keys))
        if len(self.check_of) > self.bound:
            self._trim()

    def holds_any(self, keys: Sequence[Hashable]) -> bool:
        """Whether some of ``keys`` is here (one C loop)."""
        return bool(self.check_of) and not self.check_of.keys().isdisjoint(keys)

    def discard(self, keys: Sequence[Hashable]) -> None:
        """Forget ``keys`` (found after all, or written here). Usually none of them is here
        (``unknown`` let them through): the pops only when needed."""
        if self.holds_any(keys):
            for _ in map(self.check_of.pop, keys, repeat(None)):  # a C loop: no frame per key
                pass

    def prune(self, now: float) -> None:
        """Forget the keys whose expiry has passed."""
        checks, check_of = self._checks, self.check_of
        while checks and checks[0][1] <= now:
            number, _, keys = checks.popleft()
            for key in keys:
                if check_of.get(key) == number:  # not found absent again since
                    del check_of[key]

    def _trim(self) -> None:
        """Forget the oldest checks' keys until ``bound`` remain."""
        checks, check_of = self._checks, self.check_of
        while len(check_of) > self.bound:
            number, expiry, keys = checks.popleft()
            for i, key in enumerate(keys):
                if check_of.get(key) == number:
                    del check_of[key]
                    if len(check_of) <= self.bound:
                        if i + 1 < len(keys):  # the rest of this check stays, the oldest
                            checks.appendleft((number, expiry, keys[i + 1:]))
                        break

    def check_invariants(self) -> None:
        assert len(self.check_of) <= self.bound
        queued: dict[Hashable, int] = {}
        for number, _, keys in self._checks:
            queued.update(dict.fromkeys(keys, number))
        assert all(queued.get(k) == n for k, n in self.check_of.items()), "absent drift"
        expiries = [expiry for _, expiry, _ in self._checks]
        assert expiries == sorted(expiries), "checks out of expiry order"
