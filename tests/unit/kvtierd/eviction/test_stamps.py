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
REWRITE_LOOPS = ("live_entries", "renumber", "stamps_at")


def test_the_lru_uses_the_compiled_loops():
    assert all(getattr(lru, name) is getattr(_stamps, name)
               for name in LRU_LOOPS + REWRITE_LOOPS)


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


def random_log(rng: random.Random, slots: int) -> tuple[array, array]:
    """A log of slots with garbage (older entries of re-logged slots, removed slots) and the
    stamps of its live entries (NONE for the slots not in it), as an LRU leaves them."""
    log = array("I", [rng.randrange(slots) for _ in range(rng.randint(0, 4 * slots))])
    stamp = array("I", [NONE] * slots)
    for pos, slot in enumerate(log):
        stamp[slot] = pos
    for slot in rng.sample(range(slots), rng.randint(0, slots)):  # removed since
        stamp[slot] = NONE
    return log, stamp


def test_the_rewrite_loops_match_their_python_forms():
    """A rewrite's loops on random logs (garbage, removed slots, heads past garbage, partition
    position logs with positions past the log): the same slots, stamps and positions from both
    forms, and the live entries are exactly the slots stamped with their position."""
    rng = random.Random(12)
    for _ in range(300):
        slots = rng.randint(1, 60)
        log, stamp = random_log(rng, slots)
        head = rng.randint(0, len(log))
        positions = array("I", sorted(rng.sample(range(len(log) + 5),
                                                 rng.randint(0, len(log) + 5))))
        part_head = rng.randint(0, len(positions))
        for args in ((log, stamp, None, head), (log, stamp, positions, part_head)):
            got = _stamps.live_entries(*args)
            assert got == lru.live_entries_python(*args)
        kept = array("I")
        kept.frombytes(_stamps.live_entries(log, stamp, None, 0))
        assert sorted(kept) == [s for s in range(slots) if stamp[s] != NONE]
        assert _stamps.stamps_at(stamp, kept) == lru.stamps_at_python(stamp, kept)
        stamps = [array("I", stamp) for _ in range(2)]
        _stamps.renumber(stamps[0], kept)
        lru.renumber_python(stamps[1], kept)
        assert stamps[0] == stamps[1]
        assert [stamps[0][s] for s in kept] == list(range(len(kept)))


def test_the_rewrite_loops_refuse_what_they_cannot_read():
    stamp, slots = array("I", [NONE] * 4), array("I", [0, 4])
    for form in (_stamps.renumber, lru.renumber_python):
        with pytest.raises(IndexError, match="slots\\[1\\] is 4"):
            form(stamp, slots)
        assert stamp == array("I", [NONE] * 4)  # nothing written
    with pytest.raises(IndexError, match="slots\\[1\\] is 4"):
        _stamps.stamps_at(stamp, slots)
    with pytest.raises(TypeError, match="log must be an array of 32-bit unsigned"):
        _stamps.live_entries(array("Q", [0]), stamp, None, 0)
    with pytest.raises(TypeError, match="positions must be an array of 32-bit unsigned"):
        _stamps.live_entries(array("I", [0]), stamp, array("q", [0]), 0)
