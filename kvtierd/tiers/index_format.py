"""The packed row of index schema 4: a chunk's fixed-size fields in one blob per row.

Why a blob: a restart reads every row, and Python's sqlite3 builds one object per column per row
(~0.1-0.2 µs each here, on top of the per-row step). Schema 3's six columns (space, key,
fingerprint, nbytes, checksum, runs) were 1.5 CPU-s of a million-row recovery; schema 4's three
(space, key, ``packed``) about 1 s, and the fixed fields of a whole batch are then decoded in a few
C-level passes instead of being built as objects one by one.

Layout, little-endian::

    u32 fingerprint id | u32 checksum length | i64 nbytes | checksum | (u64 start, u64 count) per run

``nbytes`` is signed so that a row with an impossible size can still be written and read back (and
then dropped by recovery, as schema 3 did). The header is 16 bytes, and the common row (a 16-byte
checksum, one run) is 48: six u64 words. ``decode_common`` turns a batch of common rows into
columns with one ``array`` over the joined blobs and one extended slice per field.

``view_fields`` decode the same fields in plain SQL (no function of ours registered), so the
``chunks`` view reads the same from the ``sqlite3`` shell as from our code.
"""

from __future__ import annotations

import struct
import sys
from array import array
from dataclasses import dataclass

HEAD = struct.Struct("<IIq")  # fingerprint id, checksum length, nbytes
RUN_BYTES = 16  # (start, count), little-endian u64 each
COMMON_CHECKSUM = 16  # xxh3-128
COMMON_BYTES = HEAD.size + COMMON_CHECKSUM + RUN_BYTES
_WORDS = COMMON_BYTES // 8  # u64 words per common row: head (2), checksum (2), start, count
_HALVES = COMMON_BYTES // 4  # u32 halves per common row: fingerprint id, checksum length first


def pack(fp_id: int, nbytes: int, checksum: bytes, runs_blob: bytes) -> bytes:
    """One row's ``packed`` (``runs_blob``: ``index_db.pack_runs``). struct.error when a field
    does not fit (nbytes beyond i64, an id beyond u32): the insert's transaction rolls back."""
    return HEAD.pack(fp_id, len(checksum), nbytes) + checksum + runs_blob


def unpack(blob: bytes) -> tuple[int, int, bytes, bytes]:
    """``(fingerprint id, nbytes, checksum, runs blob)`` of one row; ValueError when the blob is
    shorter than its header says (a damaged or hand-edited row)."""
    if len(blob) < HEAD.size:
        raise ValueError(f"packed row of {len(blob)} bytes, the header alone is {HEAD.size}")
    fp_id, sum_len, nbytes = HEAD.unpack_from(blob)
    end = HEAD.size + sum_len
    if end > len(blob):
        raise ValueError(f"packed row of {len(blob)} bytes names a {sum_len}-byte checksum")
    return fp_id, nbytes, bytes(blob[HEAD.size:end]), bytes(blob[end:])


@dataclass(frozen=True)
class Columns:
    """A batch of common rows as columns (row i is item i of each)."""
    fp_ids: array  # 'I'
    nbytes: array  # 'Q', every value below 2**63 (none was negative)
    checksums: bytes  # COMMON_CHECKSUM bytes per row, in row order
    starts: array  # 'Q': the first page of each row's only run
    counts: array  # 'Q': its page count


def decode_common(blobs: tuple[bytes, ...]) -> Columns | None:
    """The columns of a batch whose every row is common (one run, a 16-byte checksum, a size
    that is not negative), in C-level passes; None when one is not (the caller goes row by row).
    The checks compare strided byte slices and whole arrays: nothing builds an int per row."""
    n = len(blobs)
    if not n or sys.byteorder != "little" or set(map(len, blobs)) != {COMMON_BYTES}:
        return None
    joined = b"".join(blobs)
    halves = array("I", joined)
    if (halves[1::_HALVES] != array("I", [COMMON_CHECKSUM]) * n
            or not joined[HEAD.size - 1::COMMON_BYTES].isascii()):  # nbytes' top bit: negative
        return None
    words = array("Q", joined)
    sums = array("Q", bytes(COMMON_CHECKSUM * n))
    sums[0::2] = words[2::_WORDS]
    sums[1::2] = words[3::_WORDS]
    return Columns(halves[0::_HALVES], words[1::_WORDS], sums.tobytes(), words[4::_WORDS],
                   words[5::_WORDS])


def same(column: array) -> bool:
    """Whether every item of a non-empty ``column`` equals its first (one comparison of whole
    arrays, with no int built per item)."""
    return column == column[:1] * len(column)


BYTE_VALUES = "X'" + bytes(range(256)).hex().upper() + "'"  # bytes 00..FF, for ``_sql_uint``


def _sql_uint(column: str, offset: int, size: int, values: str) -> str:
    """SQL for the little-endian unsigned integer of ``size`` bytes at byte ``offset`` (0-based)
    of a blob column: a byte's value is its position in ``values`` (``BYTE_VALUES``; ``instr``
    compares blobs byte by byte), so reading the view needs no function of ours."""
    return "(" + " + ".join(f"(instr({values}, substr({column}, {offset + i + 1}, 1)) - 1)"
                            f" * {256 ** i}" for i in range(size)) + ")"


def view_fields(column: str, values: str) -> dict[str, str]:
    """SQL for the fields of the packed blob ``column``, given ``values`` (an expression whose
    value is ``BYTE_VALUES``): ``fingerprint_id``, ``checksum_len``, ``nbytes`` (the i64: its
    u64, less 2**63 twice over when the top bit is set, each step within SQLite's i64)."""
    top = _sql_uint(column, 15, 1, values)
    return {
        "fingerprint_id": _sql_uint(column, 0, 4, values),
        "checksum_len": _sql_uint(column, 4, 4, values),
        "nbytes": (f"({_sql_uint(column, 8, 7, values)} + {top} % 128 * {256 ** 7}"
                   f" - ({top} >= 128) * {(1 << 63) - 1} - ({top} >= 128))"),
    }
