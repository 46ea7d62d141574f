"""copy_in / copy_out_many: random payloads through scattered page runs, byte-exact, checksummed."""

import ctypes
import random

import pytest
import xxhash

from kvtierd.copy.memcpy import PIECE_BYTES, checksum, copy_in, copy_out_many
from kvtierd.tiers.chunk import segments

PAGE = 4096
POISON = 0xAB


def address(buf: bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def scattered_runs(rng: random.Random, npages: int) -> tuple[list[tuple[int, int]], int]:
    """Runs covering npages pages, placed out of order with gaps; returns (runs, total pages)."""
    lengths = []
    while sum(lengths) < npages:
        lengths.append(min(rng.choice([1, 2, 5, 200]), npages - sum(lengths)))
    order = list(range(len(lengths)))
    rng.shuffle(order)
    runs: list[tuple[int, int] | None] = [None] * len(lengths)
    page = rng.randint(0, 2)
    for i in order:
        runs[i] = (page, lengths[i])
        page += lengths[i] + rng.randint(0, 2)
    return runs, page + 1


@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 1024**2 + 7, 3 * 1024**2])
@pytest.mark.parametrize("seed", [0, 1])
def test_round_trip_through_scattered_segments(nbytes, seed):
    rng = random.Random(seed * 7919 + nbytes)
    payload = rng.randbytes(nbytes)
    runs, total_pages = scattered_runs(rng, -(-nbytes // PAGE))
    segs = segments(runs, nbytes, PAGE)
    assert sum(n for _, n in segs) == nbytes
    if nbytes > 1024**2:
        assert any(n > PIECE_BYTES for _, n in segs)  # hashing really goes piece by piece

    src_offset = rng.randint(0, 100)
    src = bytearray(rng.randbytes(src_offset)) + payload + bytearray(rng.randbytes(13))
    arena = bytearray([POISON]) * (total_pages * PAGE)
    digest = copy_in(address(src), src_offset, address(arena), segs, memoryview(arena))

    assert digest == xxhash.xxh3_128_digest(payload)
    assert b"".join(arena[o : o + n] for o, n in segs) == payload
    outside = bytearray(arena)
    for o, n in segs:
        outside[o : o + n] = bytes([POISON]) * n
    assert outside == bytearray([POISON]) * len(arena)  # nothing written outside the segments
    assert checksum(memoryview(arena), segs) == digest

    dst_offset = rng.randint(0, 100)
    dst = bytearray([POISON]) * (dst_offset + nbytes + 64)
    # back as a GET job copies a chunk's ranges out: one after another into one destination range
    starts = [dst_offset + sum(n for _, n in segs[:i]) for i in range(len(segs))]
    copy_out_many(address(arena), [o for o, _ in segs], address(dst), starts, [n for _, n in segs])
    assert dst[dst_offset : dst_offset + nbytes] == payload
    assert dst[:dst_offset] == bytearray([POISON]) * dst_offset
    assert dst[dst_offset + nbytes :] == bytearray([POISON]) * 64


def test_checksum_depends_on_segment_order():
    rng = random.Random(3)
    arena = bytearray(rng.randbytes(4 * PAGE))
    segs = [(2 * PAGE, PAGE), (0, PAGE)]
    assert checksum(memoryview(arena), segs) == xxhash.xxh3_128_digest(
        bytes(arena[2 * PAGE : 3 * PAGE]) + bytes(arena[:PAGE])
    )
    assert checksum(memoryview(arena), segs) != checksum(memoryview(arena), segs[::-1])
