"""index_format: schema 4's packed row, decoded one by one, in bulk, and in plain SQL (the view)."""

from __future__ import annotations

import random
import sqlite3
import struct

import pytest

from kvtierd.tiers import index_format
from kvtierd.tiers.index_db import pack_runs, unpack_runs


def common_rows(rng: random.Random, n: int) -> list[tuple[int, int, bytes, list]]:
    return [(rng.randrange(1 << 32), rng.randrange(1 << 63), rng.randbytes(16),
             [(rng.randrange(1 << 64), rng.randrange(1 << 64))]) for _ in range(n)]


def test_pack_unpack_round_trip_with_any_checksum_and_runs():
    rng = random.Random(1)
    for fp_id, nbytes, checksum, runs in [
            (0, 0, b"", []), ((1 << 32) - 1, -(1 << 63), rng.randbytes(64), [(1, 2)] * 5),
            (7, (1 << 63) - 1, b"\0" * 16, [(0, 1)]), (3, -5, b"\xff", [])]:
        blob = index_format.pack(fp_id, nbytes, checksum, pack_runs(runs))
        got = index_format.unpack(blob)
        assert got[:3] == (fp_id, nbytes, checksum) and unpack_runs(got[3]) == runs


def test_unpack_refuses_a_blob_shorter_than_its_header_says():
    with pytest.raises(ValueError, match="header"):
        index_format.unpack(b"\1\2\3")
    with pytest.raises(ValueError, match="16-byte checksum"):
        index_format.unpack(index_format.HEAD.pack(1, 16, 10) + b"short")


def test_pack_refuses_fields_that_do_not_fit():
    with pytest.raises(struct.error):
        index_format.pack(1 << 32, 10, b"", b"")
    with pytest.raises(struct.error):
        index_format.pack(1, 1 << 63, b"", b"")


def test_decode_common_gives_the_columns_of_every_row_in_order():
    rows = common_rows(random.Random(2), 500)
    cols = index_format.decode_common(tuple(
        index_format.pack(f, n, c, pack_runs(r)) for f, n, c, r in rows))
    assert cols is not None
    assert list(cols.fp_ids) == [f for f, *_ in rows]
    assert list(cols.nbytes) == [n for _, n, *_ in rows]
    assert cols.checksums == b"".join(c for *_, c, _ in rows)
    assert list(cols.starts) == [r[0][0] for *_, r in rows]
    assert list(cols.counts) == [r[0][1] for *_, r in rows]


@pytest.mark.parametrize("odd", [
    (1, -1, b"\1" * 16, [(1, 1)]),  # a negative size
    (1, 10, b"\1" * 15, [(1, 1), (0, 0)]),  # another checksum length (not 48 bytes either)
    (1, 10, b"\1" * 32, []),  # 48 bytes, but a 32-byte checksum and no run
    (1, 10, b"\1" * 16, [(1, 1), (3, 1)]),  # two runs
])
def test_decode_common_leaves_a_batch_with_one_uncommon_row_to_the_row_path(odd):
    rows = common_rows(random.Random(3), 20)
    rows.insert(7, odd)
    blobs = tuple(index_format.pack(f, n, c, pack_runs(r)) for f, n, c, r in rows)
    assert index_format.decode_common(blobs) is None
    assert index_format.decode_common(blobs[:7] + blobs[8:]) is not None


def test_same_compares_whole_columns():
    from array import array

    assert index_format.same(array("Q", [5] * 9))
    assert not index_format.same(array("Q", [5] * 8 + [6]))


def test_view_fields_decode_the_blob_in_plain_sql_as_unpack_does():
    rng = random.Random(4)
    rows = [(0, 0, b"", []), ((1 << 32) - 1, -(1 << 63), rng.randbytes(33), [(5, 6)] * 3),
            (9, (1 << 63) - 1, bytes(16), [(0, 1)]), (4, -1, b"\x80", []),
            *[(rng.randrange(1 << 32), rng.randrange(-(1 << 63), 1 << 63),
               rng.randbytes(rng.randrange(40)), [(rng.randrange(1 << 64), 1)])
              for _ in range(200)]]
    db = sqlite3.connect(":memory:")  # no function of ours registered
    db.execute("CREATE TABLE e (packed BLOB)")
    blobs = [index_format.pack(f, n, c, pack_runs(r)) for f, n, c, r in rows]
    db.executemany("INSERT INTO e VALUES (?)", [(b,) for b in blobs])
    fields = index_format.view_fields("x.packed", "b.v")
    start = index_format.HEAD.size + 1
    got = db.execute(
        f"SELECT {fields['fingerprint_id']}, {fields['nbytes']},"
        f" substr(x.packed, {start}, {fields['checksum_len']}),"
        f" substr(x.packed, {start} + {fields['checksum_len']})"
        f" FROM e x, (SELECT {index_format.BYTE_VALUES} AS v) b ORDER BY x.rowid").fetchall()
    assert got == [index_format.unpack(b) for b in blobs]
