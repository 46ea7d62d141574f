"""PartitionedPolicy: one LRU over all keys and one per tenant, always in step."""

import random

from kvtierd.eviction.lru import LRUPolicy
from kvtierd.eviction.partitioned import PartitionedPolicy


def test_partitions_follow_the_shared_order_and_stay_in_step():
    policy = PartitionedPolicy(LRUPolicy, lambda key: key[0])
    naive: list = []  # the shared LRU order, coldest first
    rng = random.Random(5)
    for _ in range(3000):
        key = (rng.choice("abc"), rng.randrange(40))
        op = rng.random()
        if op < 0.5:
            policy.insert(key)
            if key in naive:
                naive.remove(key)
            naive.append(key)
        elif op < 0.8:
            policy.touch(key)
            if key in naive:
                naive.remove(key)
                naive.append(key)
        else:
            policy.remove(key)
            if key in naive:
                naive.remove(key)
        policy.check_invariants()
    assert list(policy.victims()) == naive and len(policy) == len(naive)
    for tenant in "abc":
        assert list(policy.victims_of(tenant)) == [k for k in naive if k[0] == tenant]
    assert list(policy.victims_of("nobody")) == []


def test_an_emptied_partition_is_dropped():
    policy = PartitionedPolicy(LRUPolicy, lambda key: key[0])
    policy.insert(("a", 1))
    policy.remove(("a", 1))
    policy.touch(("a", 1))  # absent: no-op, no partition made
    assert list(policy.victims_of("a")) == [] and len(policy) == 0
    policy.check_invariants()
