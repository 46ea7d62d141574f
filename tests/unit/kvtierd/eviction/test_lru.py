"""LRUPolicy: coldest first, touch and re-insert warm a key, remove forgets, victims() is lazy."""

import random

import pytest

from kvtierd.eviction import POLICIES, LRUPolicy, make_policy


def test_insertion_order_is_eviction_order():
    policy = LRUPolicy()
    rng = random.Random(1)
    keys = [("ns", rng.randbytes(8)) for _ in range(5)]
    for key in keys:
        policy.insert(key)
    assert list(policy.victims()) == keys and len(policy) == 5


def test_touch_and_reinsert_move_to_the_back():
    policy = LRUPolicy()
    for key in "abcd":
        policy.insert(key)
    policy.touch("b")
    policy.insert("a")  # a second insert also counts as use
    assert list(policy.victims()) == ["c", "d", "b", "a"]
    policy.touch("zz")  # touching an unknown key does not start tracking it
    assert "zz" not in list(policy.victims()) and len(policy) == 4


def test_remove():
    policy = LRUPolicy()
    for key in "abc":
        policy.insert(key)
    policy.remove("b")
    policy.remove("nope")  # unknown keys are ignored
    assert list(policy.victims()) == ["a", "c"] and len(policy) == 2


def test_random_sequence_matches_model():
    rng = random.Random(7)
    policy, model = LRUPolicy(), []
    for _ in range(500):
        key, op = rng.randrange(20), rng.choice(["insert", "touch", "remove"])
        getattr(policy, op)(key)
        if op == "insert" or (op == "touch" and key in model):
            model = [k for k in model if k != key] + [key]
        elif op == "remove":
            model = [k for k in model if k != key]
        assert list(policy.victims()) == model and len(policy) == len(model)


def test_victims_is_lazy():
    policy = LRUPolicy()
    for key in range(100_000):
        policy.insert(key)
    victims = policy.victims()
    assert iter(victims) is victims  # an iterator, not a materialised list
    assert [next(victims), next(victims)] == [0, 1]
    policy.touch(0)  # the contract: no changes while iterating, and the iterator notices
    with pytest.raises(RuntimeError):
        next(victims)


def test_registry():
    assert set(POLICIES) == {"lru"}
    assert isinstance(make_policy("lru"), LRUPolicy)
    assert make_policy("lru") is not make_policy("lru")  # one fresh policy per tier
    with pytest.raises(ValueError, match="'fifo'.*lru"):
        make_policy("fifo")
