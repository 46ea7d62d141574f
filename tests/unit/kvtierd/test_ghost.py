"""Capacity-planning ghosts: exact LRU answers against a naive reference, monotone in capacity,
bounded memory, and sampling that estimates the exact answer on large tiers. Every test runs with
both forms of the ghosts' LRU: the compiled ``kvtierd._ghost.LRU`` and its Python form."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from kvtierd import key_sample
from kvtierd.ghost import GhostCaches, GhostLRUPython

PAGE = 4096
pytestmark = pytest.mark.usefixtures("lru")  # every test with both forms (conftest.py)


class NaiveLRU:
    """The reference: a list, most recent last, evicting from the front until it fits."""

    def __init__(self, capacity_pages: int) -> None:
        self.capacity = capacity_pages
        self.order: list[tuple[object, int]] = []

    def access(self, key) -> bool:
        for i, (k, pages) in enumerate(self.order):
            if k == key:
                self.order.append(self.order.pop(i))
                return True
        return False

    def insert(self, key, pages: int) -> None:
        self.order = [(k, p) for k, p in self.order if k != key]
        if pages > self.capacity:
            return
        self.order.append((key, pages))
        while sum(p for _, p in self.order) > self.capacity:
            self.order.pop(0)


def trace(rng: random.Random, n: int, keys: int, hot: int = 0):
    """(op, key, pages) with a hot set, re-reads and deletes: what an engine fleet does."""
    for _ in range(n):
        key = rng.randrange(hot) if hot and rng.random() < 0.5 else rng.randrange(keys)
        r = rng.random()
        op = "access" if r < 0.6 else "insert" if r < 0.97 else "remove"
        yield op, (("uid:0", "model", 0), key.to_bytes(8, "little")), 1 + key % 5


@pytest.mark.parametrize("capacity_pages", [1, 7, 40, 200])
def test_ghost_lru_answers_exactly_like_a_naive_lru(capacity_pages, lru):
    rng = random.Random(capacity_pages)
    ghost, ref = lru(capacity_pages * PAGE, PAGE), NaiveLRU(capacity_pages)
    for op, ikey, pages in trace(rng, 3000, keys=120, hot=10):
        key = GhostCaches.key(ikey)
        if op == "access":
            assert ghost.access(key) == ref.access(key)
        elif op == "insert":
            ghost.insert(key, pages)
            ref.insert(key, pages)
        else:
            ghost.remove(key)
            ref.order = [(k, p) for k, p in ref.order if k != key]
        assert ghost.items() == ref.order
        ghost.check_invariants()


def test_tiers_count_real_hits_and_ghost_hits_and_larger_is_never_worse():
    # cpu: 32 pages; nvme behind it: 64 pages -> simulated 32+2*64, 32+4*64.
    ghosts = GhostCaches([("cpu", 32 * PAGE), ("nvme", 64 * PAGE)], PAGE)
    cpu, nvme = ghosts.tiers
    assert cpu.capacity_bytes == {1: 32 * PAGE, 2: 64 * PAGE, 4: 128 * PAGE}
    assert nvme.capacity_bytes == {1: 96 * PAGE, 2: 160 * PAGE, 4: 288 * PAGE}
    assert cpu.sample_ratio == nvme.sample_ratio == 1.0
    rng = random.Random(7)
    real_hits = {"cpu": 0, "nvme": 0}
    accesses = 0
    for op, ikey, pages in trace(rng, 6000, keys=400, hot=40):
        if op == "access":
            real = rng.choice([None, "cpu", "nvme"])  # what the real tiers answered
            ghosts.access(ikey, real)
            accesses += 1
            real_hits["cpu"] += real == "cpu"
            real_hits["nvme"] += real in ("cpu", "nvme")
        elif op == "insert":
            ghosts.insert(ikey, pages * PAGE - 1)
        else:
            ghosts.remove(ikey)
    ghosts.check_invariants()
    stats = ghosts.stats()
    for tier in ("cpu", "nvme"):
        assert stats[tier]["accesses"] == accesses
        assert stats[tier]["hits"]["1"] == real_hits[tier]
    # LRU's inclusion property: a larger LRU holds a superset, so it never hits less
    assert 0 < stats["cpu"]["hits"]["2"] <= stats["cpu"]["hits"]["4"] <= \
        stats["nvme"]["hits"]["2"] <= stats["nvme"]["hits"]["4"] <= accesses
    assert stats["cpu"]["keys"]["2"] <= stats["cpu"]["keys"]["4"]


def test_a_get_touch_refreshes_recency_without_counting_an_access():
    """A LOOKUP counts the chunk request; the GET that loads it must not count it again (hit
    ratios would read high), but it is a read the real LRU sees, so it keeps the key warm."""
    ghosts = GhostCaches([("cpu", 2 * PAGE)], PAGE, scales=(2,))  # the 2x ghost holds 4 pages
    keys = [(("uid:0", "ns", 0), bytes([k]) * 8) for k in range(5)]
    for ikey in keys[:4]:
        ghosts.insert(ikey, PAGE)
    ghosts.touch(keys[0])  # now the most recent: the next insert evicts keys[1] instead
    ghosts.insert(keys[4], PAGE)
    assert ghosts.stats()["cpu"]["accesses"] == 0
    ghosts.access(keys[0], "cpu")
    assert ghosts.stats()["cpu"]["hits"] == {"1": 1, "2": 1}  # kept by the touch
    ghosts.access(keys[1], None)
    stats = ghosts.stats()["cpu"]
    assert stats["accesses"] == 2 and stats["hits"] == {"1": 1, "2": 1}  # evicted in its place
    ghosts.check_invariants()


def test_a_chunk_larger_than_the_ghost_is_not_held(lru):
    ghost = lru(4 * PAGE, PAGE)
    ghost.insert(1, 2)
    ghost.insert(2, 5)
    assert 1 in ghost and 2 not in ghost and ghost.used_pages == 2


def test_large_tiers_are_sampled_and_estimate_the_exact_hit_ratio():
    """A tier whose 4x ghost could hold more than max_keys keys simulates a sample of the keys."""
    rng = random.Random(3)
    exact = GhostCaches([("cpu", 4000 * PAGE)], PAGE, max_keys=1 << 30)
    sampled = GhostCaches([("cpu", 4000 * PAGE)], PAGE, max_keys=4000)
    assert exact.tiers[0].sample_ratio == 1.0
    assert sampled.tiers[0].sample_ratio == pytest.approx(0.25)
    assert sampled.tiers[0].ghosts[4].capacity_bytes == 4000 * PAGE
    zipf = [1 / (k + 1) ** 0.6 for k in range(60000)]
    keys = rng.choices(range(60000), weights=zipf, k=100000)
    for key in keys:
        ikey = (("uid:0", "m", 0), key.to_bytes(4, "little"))
        for ghosts in (exact, sampled):
            ghosts.access(ikey, None)
            ghosts.insert(ikey, PAGE)
    for scale in ("2", "4"):
        e, s = (g.stats()["cpu"] for g in (exact, sampled))
        exact_ratio = e["hits"][scale] / e["accesses"]
        sampled_ratio = s["hits"][scale] / s["accesses"]
        assert 0.2 < exact_ratio < 0.6
        assert sampled_ratio == pytest.approx(exact_ratio, abs=0.03), scale
        assert s["keys"][scale] <= 4000
        assert s["accesses"] == pytest.approx(e["accesses"] * 0.25, rel=0.1)


#: What a key costs each form, as kvtierd.ghost and the README say: about 40 bytes compiled (flat
#: arrays and a half-full table, grown by doubling), about 140 as an OrderedDict node.
BYTES_PER_KEY = {"compiled": (20, 64), "python": (60, 200)}


def test_memory_per_key_is_what_the_docs_say(lru, request):
    """The README and kvtierd.ghost promise ~40 bytes a key compiled, ~140 in the Python form."""
    form = request.node.callspec.params["lru"]
    ghost = lru(1 << 40, PAGE)
    rng = random.Random(1)
    keys = [GhostCaches.key((("uid:0", "m", 0), rng.randbytes(16))) for _ in range(50000)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for key in keys:
            ghost.insert(key, 3)
        per_key = (tracemalloc.get_traced_memory()[0] - before) / len(keys)
    finally:
        tracemalloc.stop()
    low, high = BYTES_PER_KEY[form]
    assert low < per_key < high, per_key


@pytest.mark.parametrize("sampling", ["compiled", "python"])  # kvtierd.key_sample's two forms
@pytest.mark.parametrize("max_keys", [1 << 30, 300])  # exact, and sampled (a key subset)
def test_batch_feeds_leave_the_ghosts_exactly_as_per_key_feeds(max_keys, sampling, monkeypatch):
    """insert_many / touch_many / remove_many (what PUT, GET and DELETE call once per batch) are
    the per-key sequence, with the batches sampled by the compiled loop or its Python form."""
    if sampling == "python":
        monkeypatch.setattr(key_sample, "below", key_sample.below_python)
        monkeypatch.setattr(key_sample, "below_at", key_sample.below_at_python)
    rng = random.Random(max_keys)
    space = ("uid:0", "ns", 3)
    tiers = [("cpu", 200 * PAGE), ("nvme", 300 * PAGE)]
    one = GhostCaches(tiers, PAGE, max_keys=max_keys)
    many = GhostCaches(tiers, PAGE, max_keys=max_keys)
    assert (one.tiers[0].sample_ratio < 1.0) == (max_keys == 300)
    stored: list[bytes] = []
    for _ in range(40):
        keys = [f"k{rng.randrange(900)}".encode() for _ in range(rng.randint(1, 60))]
        draw = rng.random()
        if draw < 0.5:
            sizes = [rng.choice([1, PAGE, 3 * PAGE + 5, 500 * PAGE]) for _ in keys]
            if draw < 0.2:  # one chunk size for the whole batch (most PUTs)
                sizes = [sizes[0]] * len(keys)
            for key, nbytes in zip(keys, sizes):
                one.insert((space, key), nbytes)
            many.insert_many(space, keys, sizes)
            stored.extend(keys)
        elif draw < 0.65 and stored:  # a DELETE batch, mostly of stored keys
            keys = rng.sample(stored, min(len(stored), len(keys))) + keys[:2]
            for key in keys:
                one.remove((space, key))
            many.remove_many(space, keys)
        else:
            for key in keys:
                one.touch((space, key))
            many.touch_many(space, keys)
        probe = [f"k{i}".encode() for i in range(0, 900, 7)]
        for key in probe:
            one.access((space, key), None)
            many.access((space, key), None)
    for a, b in zip(one.tiers, many.tiers):
        assert a.stats() == b.stats()
        for scale in a.ghosts:
            assert a.ghosts[scale].items() == b.ghosts[scale].items()
    many.check_invariants()
    assert sum(len(g) for t in many.tiers for g in t.ghosts.values()) > 0


@pytest.mark.parametrize("seed", range(4))
def test_batch_insert_of_new_keys_evicts_as_per_key_inserts(seed):
    """A PUT batch of new, distinct keys takes insert_many's bulk path (appended at once, then
    the coldest evicted): the same order and pages as one insert at a time, overflowing or not,
    and batches that do not qualify (a repeat, a known key, a key too large) take the per-key
    path."""
    rng = random.Random(seed)
    space = ("uid:0", "ns", 1)
    tiers = [("cpu", 50 * PAGE)]
    one = GhostCaches(tiers, PAGE, max_keys=1 << 30)
    many = GhostCaches(tiers, PAGE, max_keys=1 << 30)
    fresh = 0
    for step in range(30):
        keys = [f"s{step}-{i}".encode() for i in range(rng.randint(1, 40))]
        if rng.random() < 0.3:
            keys.append(rng.choice(keys))  # a repeat in the batch
        if rng.random() < 0.2 and step:
            keys.append(f"s{step - 1}-0".encode())  # a key the ghost may hold
        sizes = [rng.choice([1, PAGE, 2 * PAGE + 1, 7 * PAGE]) for _ in keys]
        if rng.random() < 0.1:
            sizes[-1] = 80 * PAGE  # larger than the ghost
        for key, nbytes in zip(keys, sizes):
            one.insert((space, key), nbytes)
        many.insert_many(space, keys, sizes)
        fresh += len(set(keys)) == len(keys)
        for scale in one.tiers[0].ghosts:
            assert (one.tiers[0].ghosts[scale].items()
                    == many.tiers[0].ghosts[scale].items()), f"step {step}"
    many.check_invariants()
    assert fresh > 5


@pytest.mark.parametrize("keys", ["hashes", "clustered"])
def test_many_keys_with_removals_keep_both_forms_in_step(lru, keys):
    """Thousands of inserts, touches and removals (the compiled table grows and shifts entries
    back on every removal) leave the same keys in the same order as the Python form. Clustered
    keys (small ints and multiples of 2**40) crowd the table's probe runs."""
    rng = random.Random(len(keys))
    universe = ([rng.getrandbits(64) for _ in range(6000)] if keys == "hashes" else
                list(range(3000)) + [i << 40 for i in range(3000)])
    ghost, ref = lru(9000 * PAGE, PAGE), GhostLRUPython(9000 * PAGE, PAGE)
    for step in range(40):
        batch = rng.sample(universe, 400)
        pages = [rng.choice([1, 2, 5]) for _ in batch]
        draw = rng.random()
        if draw < 0.5:
            ghost.insert_many(batch, pages)
            ref.insert_many(batch, pages)
        elif draw < 0.75:
            ghost.remove_many(batch)
            ref.remove_many(batch)
        else:
            assert ghost.access_many(batch) == ref.access_many(batch)
        ghost.check_invariants()
        assert ghost.items() == ref.items(), f"step {step}"
        assert ghost.used_pages == ref.used_pages and len(ghost) == len(ref)
    assert len(ghost) > 1000


def test_bad_keys_and_page_counts_are_refused_and_change_nothing(lru, request):
    """A compiled ghost's key is a 64-bit hash and a page count an int >= 0: anything else
    raises, naming the problem, and leaves the ghost as it was."""
    if request.node.callspec.params["lru"] == "python":
        pytest.skip("the Python form takes any hashable key (GhostCaches gives both forms ints)")
    ghost = lru(8 * PAGE, PAGE)
    ghost.insert_many([1, 2], [1, 1])
    for bad in ("k", None, 1.5, -1, 1 << 64):
        with pytest.raises((TypeError, OverflowError)):
            ghost.insert(bad, 1)
        with pytest.raises((TypeError, OverflowError)):
            ghost.remove_many([bad])
    with pytest.raises((TypeError, OverflowError)):
        ghost.insert(3, -2)
    assert ghost.items() == [(1, 1), (2, 1)] and ghost.used_pages == 2
    ghost.check_invariants()
    ghost.insert((1 << 64) - 1, 2)  # the largest hash is a key like any other
    assert (1 << 64) - 1 in ghost and ghost.used_pages == 4
    with pytest.raises(ValueError, match="page_bytes > 0"):
        lru(4 * PAGE, 0)
