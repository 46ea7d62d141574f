"""GhostCaches.access_many (a LOOKUP batch) counts and moves exactly what per-key access does."""

from __future__ import annotations

import random

import pytest

from kvtierd import key_sample
from kvtierd.ghost import GhostCaches

PAGE = 4096
SPACE = ("uid:1000", "ns", 0)

pytestmark = pytest.mark.usefixtures("lru")  # every test with both forms (conftest.py)


@pytest.mark.parametrize("outcomes", [["cpu", "nvme", None], ["cpu"], ["nvme"], [None]],
                         ids=["mixed", "all-cpu", "all-nvme", "all-miss"])  # uniform: no per-key
@pytest.mark.parametrize("max_keys", [1 << 17, 64])  # exact, and sampled
@pytest.mark.parametrize("sampling", ["compiled", "python"])  # kvtierd.key_sample's two forms
def test_access_many_matches_access_key_by_key(max_keys, outcomes, sampling, monkeypatch):
    if sampling == "python":
        monkeypatch.setattr(key_sample, "below", key_sample.below_python)
        monkeypatch.setattr(key_sample, "below_at", key_sample.below_at_python)
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
        hits = [rng.choice(outcomes) for _ in batch]
        batched.access_many(SPACE, batch, hits)
        for key, hit in zip(batch, hits):
            single.access((SPACE, key), hit)
    assert batched.stats() == single.stats()
    assert any(t["accesses"] for t in batched.stats().values())
    for a, b in zip(batched.tiers, single.tiers):  # the same keys in the same LRU order
        for scale in a.ghosts:
            assert a.ghosts[scale].items() == b.ghosts[scale].items()
    batched.check_invariants()



def test_a_sampled_tier_fed_by_lookup_batches_estimates_the_exact_hit_ratios():
    """Fed the way the daemon feeds them (1024-key LOOKUP batches, the misses then stored), ghosts
    that simulate a tenth of the keys give the hit ratios of an exact simulation of the same
    stream at every scale (the sample is xxh3 of the key: the same keys in every run)."""
    rng = random.Random(14)
    tiers = [("cpu", 20_000 * PAGE)]
    sampled = GhostCaches(tiers, PAGE, max_keys=8192)
    exact = GhostCaches(tiers, PAGE, max_keys=1 << 30)
    assert sampled.tiers[0].sample_ratio == pytest.approx(0.1024)
    universe = [rng.randbytes(16) for _ in range(200_000)]
    weights = [1 / (k + 1) ** 0.6 for k in range(len(universe))]
    stream = rng.choices(universe, weights=weights, k=150 * 1024)
    for i in range(0, len(stream), 1024):
        batch = stream[i:i + 1024]
        for ghosts in (sampled, exact):
            ghosts.access_many(SPACE, batch, [None] * len(batch))
            ghosts.insert_many(SPACE, batch, [PAGE] * len(batch))
    s, e = sampled.stats()["cpu"], exact.stats()["cpu"]
    assert s["accesses"] == pytest.approx(e["accesses"] * 0.1024, rel=0.1)
    assert e["keys"] == {"2": 40_000, "4": 80_000}  # both scales full: capacity decides
    ratios = {k: e["hits"][k] / e["accesses"] for k in ("2", "4")}
    assert 0.3 < ratios["2"] < ratios["4"] - 0.05 < 0.5, ratios
    for scale, exact_ratio in ratios.items():
        assert s["hits"][scale] / s["accesses"] == pytest.approx(exact_ratio, abs=0.02), scale
    sampled.check_invariants()
