"""kvtierd.eviction._stamps: the LRU's compiled batch loops (kvtierd/eviction/_stamps.c) against
their Python forms in kvtierd/eviction/lru.py, and the calls they refuse. (test_lru.py runs every
policy test with both forms.)

The test environment builds the extension (``pip install -e .`` compiles it in place), so the
first test fails where it did not build: the policy would then run its Python loops.
"""

from __future__ import annotations

import random
from array import array

import pytest

from kvtierd.eviction import _stamps, lru
from kvtierd.eviction.lru import NONE
LRU_LOOPS = ("stamp_members", "stamp_inserted", "unstamp_members")


def test_the_lru_uses_the_compiled_loops():
    assert all(getattr(lru, name) is getattr(_stamps, name) for name in LRU_LOOPS)


def test_the_lru_loops_match_their_python_forms():
    """The eviction policy's batch loops (kvtierd/eviction/lru.py) on random stamp/member
    columns and batches (members, non-members, repeats, slots past the end): the same columns
    and the same counts from both forms."""
    rng = random.Random(11)
    n = 300
    for _ in range(300):
        member = bytearray(rng.choice([0, 1]) for _ in range(n))
        stamp = array("I", [rng.randrange(NONE) if m else NONE for m in member])
        columns = [(array("I", stamp), bytearray(member)) for _ in range(2)]
        slots = [rng.randrange(n + 5) for _ in range(rng.randint(0, 40))]
        start = rng.randrange(1 << 31)
        name = rng.choice(LRU_LOOPS)
        if name == "stamp_inserted":
            slots = [slot % n for slot in slots]
        arg = NONE if name == "unstamp_members" else start
        got = [getattr(lru, f"{name}_python")(*columns[0], slots, arg),
               getattr(_stamps, name)(*columns[1], slots, arg)]
        assert got[0] == got[1] and columns[0] == columns[1], name


def test_the_lru_loops_refuse_what_they_cannot_store():
    stamp, member = array("I", [NONE] * 4), bytearray(4)
    with pytest.raises(OverflowError, match="do not fit 32 bits"):
        _stamps.stamp_inserted(stamp, member, [0, 1], NONE - 1)
    with pytest.raises(IndexError, match="slots\\[1\\] is 4"):
        _stamps.stamp_inserted(stamp, member, [0, 4], 0)
    with pytest.raises(TypeError, match="32-bit unsigned"):
        _stamps.stamp_members(array("Q", [0] * 4), member, [0], 0)
    assert stamp == array("I", [NONE] * 4) and member == bytearray(4)  # nothing written
