"""A batch's reads and writes of the compact index's columns at scattered slots: ``take_at``,
``same_at``, ``put_at``, ``fill_at``, ``put_records_at``.

Why: a PUT batch that reuses freed slots writes six columns at thousands of scattered slots
(``BatchEdits.add_pending``), a DELETE two, a commit two; as a Python loop that was ~0.2 µs of the
request loop per 16 KiB chunk. Each batch also reads several columns at its slots (flags, sizes,
first pages, layouts), a ``map`` of the column's ``__getitem__`` at ~0.1 µs per slot. The compiled ``kvtierd.tiers._columns`` (``setup.py``, optional
like ``kvtierd.copy._ranges``) writes a column in one call; where it was not built the Python
loops below run, with the same results (``tests/unit/kvtierd/tiers/test_columns.py`` holds the
two to each other). ``NATIVE`` says which.

The compiled calls check every slot and value before writing anything; the Python loops stop at
the first bad one (an index bug either way: the callers pass slots they took from the index).
"""

from __future__ import annotations

from itertools import repeat
from operator import mul
from typing import Any, MutableSequence, Sequence


def take_at_python(column: Sequence, slots: Sequence[int], scale: int = 1) -> list | bytes:
    """``[column[slot] for slot in slots]``; bytes for a column of one-byte items (the flags).
    With ``scale`` > 1 (a column of ints wider than a byte) each value times ``scale``."""
    values = map(column.__getitem__, slots)
    one_byte = isinstance(column, bytearray) or getattr(column, "itemsize", 0) == 1
    if scale != 1:
        if scale < 1:
            raise ValueError(f"scale is {scale}; allowed: an int >= 1")
        if one_byte or isinstance(column, list):
            raise TypeError(f"scale {scale} for a column of {type(column).__name__}; allowed: "
                            "1, or a column of 4- or 8-byte items")
        return list(map(mul, values, repeat(scale)))
    return bytes(values) if one_byte else list(values)


def same_at_python(column: Sequence, slots: Sequence[int]) -> Any:
    """``column[slots[0]]`` when the column holds that value at every slot, else None (None for
    no slots)."""
    values = take_at_python(column, slots)
    if not len(values) or values.count(values[0]) != len(values):
        return None
    return values[0]


def put_at_python(column: MutableSequence, slots: Sequence[int], values: Sequence[Any]) -> None:
    """``column[slots[i]] = values[i]`` for every i (values may be longer, as zip pairs them)."""
    for slot, value in zip(slots, values):
        column[slot] = value


def fill_at_python(column: MutableSequence, slots: Sequence[int], value: Any) -> None:
    """``column[slot] = value`` for every slot."""
    for slot in slots:
        column[slot] = value


def put_records_at_python(buffer: bytearray, slots: Sequence[int], records: Sequence[bytes],
                          width: int) -> None:
    """``buffer[slot * width:(slot + 1) * width] = records[i]`` for every (i, slot)."""
    view = memoryview(buffer)  # slice assignment: a third of a bytearray's cost
    try:
        for slot, record in zip(slots, records):
            at = slot * width
            view[at:at + width] = record
    finally:
        view.release()


try:
    from kvtierd.tiers._columns import fill_at, put_at, put_records_at, same_at, take_at
    NATIVE = "compiled"
except ImportError:  # built without a C compiler (setup.py: the extension is optional)
    put_at, fill_at, put_records_at = put_at_python, fill_at_python, put_records_at_python
    take_at, same_at = take_at_python, same_at_python
    NATIVE = "python"
