"""LRUPolicy over slots: coldest first, touch and re-insert warm a slot, remove forgets, per-part
order, rewrites keep the order, victims() is lazy."""

import random

import pytest

from kvtierd.eviction import POLICIES, LRUPolicy, lru, make_policy
from kvtierd.eviction.lru import _GARBAGE

LOOPS = ("stamp_members", "stamp_inserted", "unstamp_members", "live_entries", "renumber",
         "stamps_at")


@pytest.fixture(autouse=True, params=["compiled", "python"])
def batch_loops(request, monkeypatch):
    """Every test runs with the compiled batch loops (kvtierd.tiers._columns) and with their
    Python forms (where the extension was not built)."""
    if request.param == "python":
        for name in LOOPS:
            monkeypatch.setattr(lru, name, getattr(lru, f"{name}_python"))
    return request.param


def test_insertion_order_is_eviction_order():
    policy = LRUPolicy()
    slots = random.Random(1).sample(range(1000), 5)
    for slot in slots:
        policy.insert(slot, 0)
    assert list(policy.victims()) == slots and len(policy) == 5
    policy.check_invariants()


def test_touch_and_reinsert_move_to_the_back():
    policy = LRUPolicy()
    for slot in range(4):
        policy.insert(slot, 0)
    policy.touch(1, 0)
    policy.insert(0, 0)  # a second insert also counts as use
    assert list(policy.victims()) == [2, 3, 1, 0]
    policy.touch(99, 0)  # touching an unknown slot does not start tracking it
    assert 99 not in policy and 99 not in list(policy.victims()) and len(policy) == 4


def test_remove():
    policy = LRUPolicy()
    for slot in range(3):
        policy.insert(slot, 0)
    policy.remove(1)
    policy.remove(77)  # unknown slots are ignored
    assert list(policy.victims()) == [0, 2] and len(policy) == 2 and 1 not in policy


@pytest.mark.parametrize("slack", [0, 3, 65536])
def test_random_sequence_matches_a_model_in_every_part(slack):
    rng = random.Random(7 + slack)
    policy, model, part_of = LRUPolicy(slack=slack), [], {}
    for _ in range(2000):
        slot, op = rng.randrange(30), rng.choice(["insert", "touch", "touch", "remove"])
        if op == "insert":
            part = part_of.get(slot) if slot in model else rng.randrange(3)
            part_of[slot] = part
            policy.insert(slot, part)
            model = [s for s in model if s != slot] + [slot]
        elif op == "touch":
            policy.touch(slot, part_of.get(slot, 0))
            if slot in model:
                model = [s for s in model if s != slot] + [slot]
        else:
            policy.remove(slot)
            model = [s for s in model if s != slot]
        assert list(policy.victims()) == model and len(policy) == len(model)
        for part in range(3):
            assert list(policy.victims(part)) == [s for s in model if part_of[s] == part]
    policy.check_invariants()
    if slack == 0:
        assert policy.rewrites > 0  # the rewrite path ran and kept the order


def test_garbage_stays_bounded_under_touches():
    policy = LRUPolicy(slack=100)
    for slot in range(50):
        policy.insert(slot, slot % 2)
    for i in range(10_000):
        policy.touch(i % 50, (i % 50) % 2)
    assert len(policy._log) <= (1 + _GARBAGE) * 50 + 101
    assert list(policy.victims()) == list(range(50))  # 10_000 touches in slot order
    policy.check_invariants()


def test_victims_is_lazy():
    policy = LRUPolicy()
    for slot in range(100_000):
        policy.insert(slot, 0)
    victims = policy.victims()
    assert iter(victims) is victims  # an iterator, not a materialised list
    assert [next(victims), next(victims)] == [0, 1]


def test_registry():
    assert set(POLICIES) == {"lru"}
    assert isinstance(make_policy("lru"), LRUPolicy)
    assert make_policy("lru") is not make_policy("lru")  # one fresh policy per tier
    with pytest.raises(ValueError, match="'fifo'.*lru"):
        make_policy("fifo")


@pytest.mark.parametrize("slack", [0, 65536])
def test_touch_many_is_one_touch_per_slot_in_order(slack):
    """A LOOKUP batch's touches (touch_many) leave the order one touch per slot would: with
    duplicates, non-members (never inserted, removed, past the end) anywhere in the batch,
    partitions, and rewrites in between (slack 0)."""
    rng = random.Random(11 + slack)
    many, one = LRUPolicy(slack=slack), LRUPolicy(slack=slack)
    part_of = {}
    for slot in range(40):
        part_of[slot] = rng.choice([-1, 0, 1])
        for policy in (many, one):
            policy.insert(slot, part_of[slot])
    removed: list[int] = []
    for step in range(300):
        part = rng.choice([-1, 0, 1])
        members = [s for s in range(40) if part_of[s] == part and s not in removed]
        batch = [rng.choice(members) for _ in range(rng.randint(1, 12))]
        if step % 3 == 0:  # a non-member somewhere: removed, never inserted, past the end
            batch.insert(rng.randrange(len(batch) + 1), rng.choice([*removed[-1:], 45, 1000]))
        if step % 3 == 1 and removed:  # one below the end of the slots: stamped before it
            batch.insert(rng.randrange(len(batch) + 1), removed[0])
        many.touch_many(batch, part)
        for slot in batch:
            one.touch(slot, part)
        if step % 25 == 24:  # a slot leaves the policy; the oldest one that left comes back
            gone = rng.choice(members)
            for policy in (many, one):
                policy.remove(gone)
            removed.append(gone)
            if len(removed) > 2:
                back = removed.pop(0)
                for policy in (many, one):
                    policy.insert(back, part_of[back])
        assert list(many.victims()) == list(one.victims())
        for p in (0, 1):
            assert list(many.victims(p)) == list(one.victims(p))
    many.check_invariants()
    if slack == 0:
        assert many.rewrites > 0


def test_batched_touches_on_a_random_workload_match_the_per_key_reference():
    """LOOKUP-sized batches (up to 300 hits, duplicates, a few non-members) over 3000 slots in
    three partitions, interleaved with inserts and removes: the eviction order, overall and per
    partition, equals per-key touches after every step, through many rewrites; the log never
    holds more than 1 + _GARBAGE entries per live slot plus the slack and one batch."""
    rng = random.Random(2026)
    slack = 50
    many, one = LRUPolicy(slack=slack), LRUPolicy(slack=slack)
    part_of = {slot: rng.choice([-1, 0, 1]) for slot in range(3000)}
    for slot in range(3000):
        for policy in (many, one):
            policy.insert(slot, part_of[slot])
    members = set(range(3000))
    for step in range(200):
        part = rng.choice([-1, 0, 1])
        pool = [s for s in members if part_of[s] == part]
        batch = [rng.choice(pool) for _ in range(rng.randint(1, 300))]
        if step % 4 == 0:  # a non-member: past the end, or removed
            outside = sorted(set(range(3000)) - members)
            batch.insert(rng.randrange(len(batch)), rng.choice([5000, *outside]))
        many.touch_many(batch, part)
        for slot in batch:
            one.touch(slot, part)
        for _ in range(rng.randint(0, 20)):
            slot = rng.randrange(3000)
            if slot in members and rng.random() < 0.5:
                members.discard(slot)
                for policy in (many, one):
                    policy.remove(slot)
            else:
                members.add(slot)
                for policy in (many, one):
                    policy.insert(slot, part_of[slot])
        assert len(many._log) - many._head <= (1 + _GARBAGE) * len(members) + slack + 301
        if step % 20 == 19:
            assert list(many.victims()) == list(one.victims())
            for p in (0, 1):
                assert list(many.victims(p)) == list(one.victims(p))
    assert list(many.victims()) == list(one.victims())
    assert many.rewrites >= 3
    many.check_invariants()


@pytest.mark.parametrize("slack", [0, 65536])
def test_remove_many_is_one_remove_per_slot(slack):
    """A DELETE batch's removals (remove_many) leave what one remove per slot leaves, with
    non-members (removed, never inserted, past the end) and duplicates in the batch, partitions
    and rewrites in between."""
    rng = random.Random(5 + slack)
    many, one = LRUPolicy(slack=slack), LRUPolicy(slack=slack)
    part_of = {slot: rng.choice([-1, 0, 1]) for slot in range(60)}
    for step in range(200):
        batch = [rng.randrange(70) for _ in range(rng.randint(0, 8))]
        many.remove_many(batch)
        for slot in batch:
            one.remove(slot)
        for _ in range(rng.randint(0, 6)):
            slot = rng.randrange(60)
            for policy in (many, one):
                policy.insert(slot, part_of[slot])
        assert list(many.victims()) == list(one.victims()) and len(many) == len(one)
        for part in (0, 1):
            assert list(many.victims(part)) == list(one.victims(part))
    many.check_invariants()


@pytest.mark.parametrize("slack", [0, 65536])
def test_insert_many_of_a_list_is_one_insert_per_slot(slack):
    """A PUT batch's commits (insert_many of a list) leave what one insert per slot leaves: new
    slots past the end, members re-inserted, duplicates, partitions, rewrites in between."""
    rng = random.Random(9 + slack)
    many, one = LRUPolicy(slack=slack), LRUPolicy(slack=slack)
    for step in range(150):
        part = rng.choice([-1, 0, 1])
        top = 30 if step % 2 else 30 + step  # re-inserts (garbage) and new slots past the end
        batch = [rng.randrange(top) for _ in range(rng.randint(0, 10))]
        many.insert_many(batch, part)
        for slot in batch:
            one.insert(slot, part)
        gone = rng.randrange(top)
        for policy in (many, one):
            policy.remove(gone)
        assert list(many.victims()) == list(one.victims()) and len(many) == len(one)
        for p in (0, 1):
            assert list(many.victims(p)) == list(one.victims(p))
    many.check_invariants()
    if slack == 0:
        assert many.rewrites > 0
