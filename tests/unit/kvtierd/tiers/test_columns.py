"""kvtierd.tiers.columns: the compiled column writes (kvtierd/tiers/_columns.c) against the Python
loops they replace, on the column types the compact index keeps (list, bytearray, array 'I' and
'Q'), at random scattered slots; and bad calls refused before anything is written.

The test environment builds the extension (``pip install -e .`` compiles it in place), so the
first test fails where it did not build: the index would then run its Python loops.
"""

from __future__ import annotations

import copy
import os
import random
import sys
from array import array

import pytest

from kvtierd.tiers import columns
from kvtierd.tiers._columns import fill_at, put_at, put_records_at, same_at, take_at

N = 500


def test_the_extension_is_built():
    assert columns.NATIVE == "compiled"
    assert columns.put_at is put_at


def fresh(kind: str, rng: random.Random):
    """Two equal columns of ``kind`` with random contents."""
    if kind == "list":
        values = [os.urandom(rng.randint(1, 9)) for _ in range(N)]
        return values, list(values)
    if kind == "bytearray":
        data = os.urandom(N)
        return bytearray(data), bytearray(data)
    top = 2**32 - 1 if kind == "I" else 2**64 - 1
    data = [rng.randint(0, top) for _ in range(N)]
    return array(kind, data), array(kind, data)


def value_of(kind: str, rng: random.Random):
    if kind == "list":
        return rng.choice([None, os.urandom(rng.randint(1, 9))])
    return rng.randint(0, {"bytearray": 255, "I": 2**32 - 1, "Q": 2**64 - 1}[kind])


@pytest.mark.parametrize("kind", ["list", "bytearray", "I", "Q"])
def test_put_and_fill_match_the_python_loops(kind):
    rng = random.Random(kind)
    compiled, reference = fresh(kind, rng)
    for _ in range(200):
        slots = rng.sample(range(N), rng.randint(0, 60))
        if rng.random() < 0.5:
            values = [value_of(kind, rng) for _ in range(len(slots) + rng.randint(0, 3))]
            put_at(compiled, slots, values)  # values may be longer: the first len(slots)
            columns.put_at_python(reference, slots, values)
        else:
            value = value_of(kind, rng)
            fill_at(compiled, slots, value)
            columns.fill_at_python(reference, slots, value)
        assert compiled == reference


@pytest.mark.parametrize("kind", ["list", "bytearray", "I", "Q"])
def test_take_matches_the_python_map(kind):
    rng = random.Random(kind)
    column, _ = fresh(kind, rng)
    for _ in range(100):
        slots = [rng.randrange(N) for _ in range(rng.randint(0, 60))]  # repeats too
        got = take_at(column, slots)
        assert got == columns.take_at_python(column, slots)
        assert type(got) is (bytes if kind == "bytearray" else list)
        assert list(got) == [column[slot] for slot in slots]


@pytest.mark.parametrize("kind", ["I", "Q"])
def test_take_with_a_scale_multiplies_each_value(kind):
    rng = random.Random(kind)
    column = array(kind, [rng.randint(0, 2**20) for _ in range(N)])
    for _ in range(50):
        slots = [rng.randrange(N) for _ in range(rng.randint(0, 60))]
        scale = rng.choice([1, 2, 4096, 65536])
        want = [column[slot] * scale for slot in slots]
        assert take_at(column, slots, scale) == want == columns.take_at_python(column, slots,
                                                                               scale)
    big = array("Q", [2**63])
    with pytest.raises(OverflowError, match="beyond 64 bits"):
        take_at(big, [0], 2)
    for bad, error in ((bytearray(4), TypeError), (array("B", [1, 2]), TypeError),
                       ([1, 2], TypeError)):
        for take in (take_at, columns.take_at_python):
            with pytest.raises(error, match="scale 3 for a column"):
                take(bad, [0], 3)
    for take in (take_at, columns.take_at_python):
        with pytest.raises(ValueError, match="scale is 0"):
            take(column, [0], 0)


@pytest.mark.parametrize("kind", ["list", "bytearray", "I", "Q"])
def test_same_at_is_the_one_value_take_at_finds(kind):
    """Batches of one value (filled so) and of several, at scattered and repeated slots: the
    value, or None, as the Python form says, and as take_at's list says."""
    rng = random.Random(kind)
    column, _ = fresh(kind, rng)
    value = value_of(kind, rng)
    for _ in range(100):
        slots = [rng.randrange(N) for _ in range(rng.randint(0, 60))]
        if rng.random() < 0.5:
            fill_at(column, slots, value)
        values = list(take_at(column, slots))
        want = values[0] if values and values.count(values[0]) == len(values) else None
        assert same_at(column, slots) == want == columns.same_at_python(column, slots)
    assert same_at(column, []) is None
    fill_at(column, [4, 9], value)
    assert same_at(column, [4, 9, 4]) == value


def test_put_records_matches_the_python_loop():
    rng = random.Random(7)
    width = 16
    compiled = bytearray(os.urandom(N * width))
    reference = bytearray(compiled)
    for _ in range(200):
        slots = rng.sample(range(N), rng.randint(0, 60))
        records = [os.urandom(width) for _ in slots]
        put_records_at(compiled, slots, records, width)
        columns.put_records_at_python(reference, slots, records, width)
        assert compiled == reference


def test_a_list_column_holds_its_new_items_and_releases_the_old():
    """References are counted right: the new items are held, the replaced ones let go."""
    column = [object() for _ in range(4)]
    old = column[2]
    new = [object()]
    put_at(column, [2], new)
    assert column[2] is new[0]
    assert sys.getrefcount(old) == 2  # ``old`` and getrefcount's argument: the column let go


@pytest.mark.parametrize("call, message", [
    (lambda c: fill_at(c["Q"], [0, N], 1), f"slots\\[1\\] is {N}; the column has {N} slots"),
    (lambda c: fill_at(c["list"], [-1], None), "slots\\[0\\] is -1"),
    (lambda c: put_at(c["I"], [0, 1], [1, 2**32]), "value 1 is 4294967296"),
    (lambda c: put_at(c["bytearray"], [3, 4], [1, -1]), "value 1 is -1"),
    (lambda c: fill_at(c["bytearray"], [3], "x"), "value 0 is 'x'"),
    (lambda c: put_at(c["Q"], [1, 2, 3], [1, 2]), "2 values for 3 slots"),
    (lambda c: put_at(c["list"], [1, 2], [b"k"]), "1 values for 2 slots"),
    (lambda c: put_records_at(c["sums"], [0, 1], [bytes(16), bytes(15)], 16),
     "records\\[1\\] is b'.*'; allowed: bytes of 16"),
    (lambda c: put_records_at(c["sums"], [0, N], [bytes(16)] * 2, 16), f"slots\\[1\\] is {N}"),
    (lambda c: fill_at(array("d", [0.0] * 4), [0], 1), "a column of format d"),
    (lambda c: take_at(c["I"], [1, N]), f"slots\\[1\\] is {N}"),
    (lambda c: take_at(c["list"], [-3]), "slots\\[0\\] is -3"),
    (lambda c: same_at(c["Q"], [0, N]), f"slots\\[1\\] is {N}"),
    (lambda c: same_at(array("d", [0.0] * 4), [0]), "a column of format d"),
])
def test_bad_calls_are_refused_before_anything_is_written(call, message):
    rng = random.Random(3)
    cols = {kind: fresh(kind, rng)[0] for kind in ("list", "bytearray", "I", "Q")}
    cols["sums"] = bytearray(os.urandom(N * 16))
    before = copy.deepcopy(cols)
    with pytest.raises((IndexError, ValueError, TypeError), match=message):
        call(cols)
    assert cols == before  # nothing written, not even the slots before the bad one

