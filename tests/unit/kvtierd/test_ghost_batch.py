"""GhostCaches.access_many (a LOOKUP batch) counts and moves exactly what per-key access does."""

from __future__ import annotations

import random

import pytest

from kvtierd.ghost import GhostCaches

PAGE = 4096
SPACE = ("uid:1000", "ns", 0)


@pytest.mark.parametrize("max_keys", [1 << 17, 64])  # exact, and sampled
def test_access_many_matches_access_key_by_key(max_keys):
    rng = random.Random(max_keys)
    tiers = [("cpu", 64 * PAGE), ("nvme", 256 * PAGE)]
    batched, single = (GhostCaches(tiers, PAGE, max_keys=max_keys) for _ in range(2))
    keys = [rng.randbytes(16) for _ in range(300)]
    sizes = [PAGE * rng.choice([1, 1, 2]) for _ in keys[:200]]
    for ghosts in (batched, single):
        for key, nbytes in zip(keys, sizes):
            ghosts.insert((SPACE, key), nbytes)
    for _ in range(20):
        batch = rng.sample(keys, 40)
        hits = [rng.choice(["cpu", "nvme", None]) for _ in batch]
        batched.access_many(SPACE, batch, hits)
        for key, hit in zip(batch, hits):
            single.access((SPACE, key), hit)
    assert batched.stats() == single.stats()
    assert any(t["accesses"] for t in batched.stats().values())
    for a, b in zip(batched.tiers, single.tiers):  # the same keys in the same LRU order
        for scale in a.ghosts:
            assert list(a.ghosts[scale]._order.items()) == list(b.ghosts[scale]._order.items())
    batched.check_invariants()
