"""kvtierd.copy._ranges (the compiled copy job) against the ctypes reference, byte for byte.

The test environment builds the extension (``pip install -e .`` compiles it in place), so these
tests insist that it is there and that its xxh3 passed the start-up check: a silent fall back to
ctypes would hide a slower daemon, not a wrong one.
"""

import ctypes
import random

import pytest
import xxhash

from kvtierd.copy import memcpy

POISON = 0xC5


def address(buf: bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def test_the_extension_is_built_and_its_xxh3_checked_out():
    assert memcpy.NATIVE == "compiled copies and xxh3"
    assert memcpy._ranges is not None and memcpy._XXH3_128
    assert memcpy._XXH3_128 == memcpy._xxh3_128_address()
    # and the streaming functions that hash ranges longer than a piece
    assert memcpy._XXH3_STREAM is not None and len(memcpy._XXH3_STREAM) == 5
    assert memcpy._XXH3_STREAM == memcpy._xxh3_stream(memcpy._XXH3_128)


def test_an_export_that_is_not_xxh3_128_is_never_used():
    assert memcpy._xxh3_128_address(("no_such_symbol",)) is None
    # XXH32 is exported too, but returns another hash: the start-up check refuses it
    assert memcpy._xxh3_128_address(("XXH32",)) is None
    assert memcpy._xxh3_128_address(("XXH32", "XXH3_128bits")) is not None


def test_the_start_up_line_says_which_copies_run():
    assert memcpy._native(None, None, None) == "ctypes"
    assert memcpy._native(memcpy._ranges, None, None) == "compiled copies, xxh3 in Python"
    assert memcpy._native(memcpy._ranges, memcpy._XXH3_128, None) == (
        "compiled copies and xxh3, long or multi-run chunks hashed in Python")
    assert memcpy._native(memcpy._ranges, memcpy._XXH3_128, memcpy._XXH3_STREAM) == (
        "compiled copies and xxh3")


def test_streaming_exports_that_are_not_xxh3_128_are_never_used():
    create, free, reset, update, digest = memcpy.XXH3_STREAM_NAMES
    # a 64-bit digest of the state returns another hash: the start-up check refuses it
    assert memcpy._xxh3_stream(memcpy._XXH3_128,
                               (create, free, reset, update, ("XXH3_64bits_digest",))) is None
    assert memcpy._xxh3_stream(memcpy._XXH3_128,
                               (create, free, ("no_such_symbol",), update, digest)) is None
    assert memcpy._xxh3_stream(memcpy._XXH3_128, (create, free, reset, ("no_such_symbol",),
                                                  digest)) is None
    assert memcpy._xxh3_stream(None) is None  # no one-shot xxh3: nothing compiled hashes


def scattered_job(rng: random.Random, count: int, nbytes: int) -> tuple[list[int], list[int], int]:
    """Source and destination offsets of ``count`` ranges of ``nbytes``, shuffled, with gaps; the
    size a buffer must have to hold either side."""
    slots = list(range(count))
    rng.shuffle(slots)
    stride = nbytes + rng.randint(0, 64)
    srcs = [i * stride + rng.randint(0, stride - nbytes) for i in range(count)]
    dsts = [slot * stride + rng.randint(0, stride - nbytes) for slot in slots]
    return srcs, dsts, count * stride


def check_copy_in(rng: random.Random, srcs: list[int], dsts: list[int], size: int,
                  sizes: int | list[int]) -> None:
    """``copy_in_ranges`` of random bytes against the ctypes reference, into poisoned buffers:
    the same digests (xxh3-128 of each source range), the same bytes, nothing outside the ranges."""
    each = [sizes] * len(srcs) if type(sizes) is int else sizes
    src = bytearray(rng.randbytes(size))
    native, reference = bytearray([POISON]) * size, bytearray([POISON]) * size

    got = memcpy.copy_in_ranges(address(src), srcs, address(native), dsts, sizes,
                                memoryview(native))
    want = memcpy.copy_in_ranges_ctypes(address(src), srcs, address(reference), dsts, sizes,
                                        memoryview(reference))

    assert got == want == [xxhash.xxh3_128_digest(src[s:s + n]) for s, n in zip(srcs, each)]
    assert native == reference  # the same bytes moved, nothing written outside the ranges
    for s, d, n in zip(srcs, dsts, each):
        assert native[d:d + n] == src[s:s + n]


PIECE = memcpy.PIECE_BYTES
HASH_PIECE = memcpy.HASH_PIECE_BYTES


@pytest.mark.parametrize("nbytes", [0, 1, 17, 240, 241, HASH_PIECE - 1, HASH_PIECE,
                                    HASH_PIECE + 1, 3 * HASH_PIECE + 17, 16384 + 3, PIECE,
                                    PIECE + 1, 2 * PIECE, 3 * PIECE + 17])
# past HASH_PIECE: compiled, streamed by pieces; past PIECE: by pieces in Python as well
def test_copy_in_ranges_matches_the_ctypes_reference(nbytes):
    rng = random.Random(nbytes)
    srcs, dsts, size = scattered_job(rng, 37 if nbytes <= PIECE else 5, nbytes)
    check_copy_in(rng, srcs, dsts, size, nbytes)


@pytest.mark.parametrize("stream", ["compiled", "python"])
@pytest.mark.parametrize("segments", [[(100, 3 * PIECE + 17)], [(PIECE + 9, 2 * PIECE)],
                                      [(0, PIECE + 1), (5 * PIECE, 7000), (3 * PIECE, PIECE)]])
def test_copy_in_of_a_chunk_longer_than_a_piece(monkeypatch, stream, segments):
    """One chunk: in one compiled call where it is one range, else (several segments, or no
    streaming exports) piece by piece in Python; the same digest and bytes either way."""
    if stream == "python":
        monkeypatch.setattr(memcpy, "_XXH3_STREAM", None)
    rng = random.Random(len(segments) * 31 + segments[0][1])
    total = sum(n for _, n in segments)
    src = bytearray(rng.randbytes(total + 123))
    dst = bytearray([POISON]) * (6 * PIECE)
    got = memcpy.copy_in(address(src), 123, address(dst), segments, memoryview(dst))
    assert got == xxhash.xxh3_128_digest(src[123:])
    expected = bytearray([POISON]) * len(dst)
    pos = 123
    for offset, length in segments:
        expected[offset:offset + length] = src[pos:pos + length]
        pos += length
    assert dst == expected


@pytest.mark.parametrize("nbytes", [16384 + 3, 2 * PIECE + 5])  # one-shot hashes; Python pieces
def test_copy_in_ranges_without_the_streaming_exports(monkeypatch, nbytes):
    monkeypatch.setattr(memcpy, "_XXH3_STREAM", None)
    rng = random.Random(77 + nbytes)
    srcs, dsts, size = scattered_job(rng, 4, nbytes)
    check_copy_in(rng, srcs, dsts, size, nbytes)


@pytest.mark.parametrize("largest", [16384, memcpy.PIECE_BYTES + 1])  # the latter: by pieces
def test_copy_in_ranges_of_one_size_per_chunk_matches_the_ctypes_reference(largest):
    rng = random.Random(largest)
    sizes = [rng.choice([0, 1, 4096, 9000, largest]) for _ in range(40)]
    srcs, dsts, size = scattered_job(rng, len(sizes), largest)
    check_copy_in(rng, srcs, dsts, size, sizes)


def test_copy_out_many_matches_the_ctypes_reference():
    rng = random.Random(5)
    sizes = [rng.choice([0, 1, 4095, 16384, 70000]) for _ in range(50)]
    srcs, dsts, size = scattered_job(rng, len(sizes), max(sizes))
    src = bytearray(rng.randbytes(size))
    native, reference = bytearray([POISON]) * size, bytearray([POISON]) * size

    memcpy.copy_out_many(address(src), srcs, address(native), dsts, sizes)
    memcpy.copy_out_many_ctypes(address(src), srcs, address(reference), dsts, sizes)

    assert native == reference
    assert any(byte != POISON for byte in native)
    for s, d, n in zip(srcs, dsts, sizes):
        assert native[d:d + n] == src[s:s + n]


def test_an_empty_job_copies_nothing():
    buf = bytearray([POISON]) * 8
    assert memcpy._ranges.copy_hash_many(address(buf), [], address(buf), [], 4,
                                         memcpy._XXH3_128) == []
    memcpy._ranges.copy_many(address(buf), (), address(buf), (), ())
    assert buf == bytearray([POISON]) * 8


@pytest.mark.parametrize("call, message", [
    (lambda r, a, h: r.copy_many(a, [0, 1], a, [0], [1, 1]), "differ in length: 2, 1, 2"),
    (lambda r, a, h: r.copy_many(a, [0], a, [0], [1, 2]), "differ in length: 1, 1, 2"),
    (lambda r, a, h: r.copy_many(a, [-3], a, [0], [1]), r"dsts\[0\] is -3"),
    (lambda r, a, h: r.copy_many(a, [0], a, [0], [-1]), r"sizes\[0\] is -1"),
    (lambda r, a, h: r.copy_hash_many(a, [0], a, [0, 1], 1, h), "differ in length: 1, 2"),
    (lambda r, a, h: r.copy_hash_many(a, [0], a, [0], [1, 1], h), "differ in length: 1, 1, 2"),
    (lambda r, a, h: r.copy_hash_many(a, [0], a, [0], [-5], h), r"sizes\[0\] is -5"),
    (lambda r, a, h: r.copy_hash_many(a, [0], a, [0], -2, h), "sizes is -2"),
    (lambda r, a, h: r.copy_hash_many(a, [0], a, [0], 1, 0), "xxh3_128_address is 0"),
    (lambda r, a, h: r.copy_hash_chunks(a, [0], a, [0], [1], [1], h, 0, (1, 2, 3, 4, 5)),
     "piece_bytes is 0; it must be > 0"),
    (lambda r, a, h: r.copy_hash_chunks(a, [0], a, [0], [1], [1], h, -1, (1, 2, 3, 4, 5)),
     "piece_bytes is -1"),
    (lambda r, a, h: r.copy_hash_chunks(a, [0], a, [0], [1], [1], h, 4, (1, 2, 0, 4, 5)),
     "stream address 2 is 0"),
    (lambda r, a, h: r.copy_hash_chunks(a, [0], a, [0], [1], [1], 0, 4, (1, 2, 3, 4, 5)),
     "xxh3_128_address is 0"),
])
def test_bad_jobs_are_refused_before_anything_is_copied(call, message):
    buf = bytearray([POISON]) * 8
    with pytest.raises(ValueError, match=message):
        call(memcpy._ranges, address(buf), memcpy._XXH3_128)
    assert buf == bytearray([POISON]) * 8


def test_a_stream_is_a_tuple_of_five_addresses():
    buf = bytearray([POISON]) * 8
    for stream in ([1, 2, 3, 4, 5], (1, 2, 3, 4), (1, 2, 3, 4, "5")):
        with pytest.raises(TypeError, match="stream is"):
            memcpy._ranges.copy_hash_chunks(address(buf), [0], address(buf), [0], [1], [1],
                                            memcpy._XXH3_128, 4, stream)
    assert buf == bytearray([POISON]) * 8


def test_offsets_must_be_integers():
    buf = bytearray(8)
    with pytest.raises(TypeError):
        memcpy._ranges.copy_many(address(buf), [0.5], address(buf), [0], [1])
    with pytest.raises(TypeError, match="dsts"):
        memcpy._ranges.copy_many(address(buf), 7, address(buf), [0], [1])


def fragmented_job(rng: random.Random, count: int) -> tuple[list[int], list[list[tuple[int, int]]],
                                                            int, int]:
    """``count`` chunks of 0 to 4 destination ranges each (sizes up to past two pieces), laid
    out without overlap in a shuffled order with gaps: (source offsets, segments, source size,
    destination size)."""
    lengths = [[rng.choice([1, 17, 4096, PIECE - 1, PIECE, PIECE + 3, 2 * PIECE + 1])
                for _ in range(rng.randint(0, 4))] for _ in range(count)]
    flat = [n for chunk in lengths for n in chunk]
    order = list(range(len(flat)))
    rng.shuffle(order)
    place, pos = {}, 0
    for i in order:
        pos += rng.randint(0, 100)
        place[i] = pos
        pos += flat[i]
    segments, offsets, k, src_pos = [], [], 0, 0
    for chunk in lengths:
        offsets.append(src_pos + 7)
        segments.append([(place[k + i], n) for i, n in enumerate(chunk)])
        k += len(chunk)
        src_pos += sum(chunk) + 7
    return offsets, segments, src_pos + 7, pos + 1


@pytest.mark.parametrize("seed", range(4))
def test_copy_in_chunks_matches_the_python_pieces(monkeypatch, seed):
    """A PUT job into a fragmented arena (chunks of several runs, some empty, some one short
    run): the compiled job against ``copy_in_python`` chunk by chunk, into poisoned memory."""
    rng = random.Random(seed)
    offsets, segments, src_size, dst_size = fragmented_job(rng, 12)
    src = bytearray(rng.randbytes(src_size))
    native, reference = bytearray([POISON]) * dst_size, bytearray([POISON]) * dst_size

    got = memcpy.copy_in_chunks(address(src), offsets, address(native), segments,
                                memoryview(native))
    want = [memcpy.copy_in_python(address(src), offset, address(reference), segs,
                                  memoryview(reference))
            for offset, segs in zip(offsets, segments)]

    assert got == want
    assert got == [xxhash.xxh3_128_digest(src[o:o + sum(n for _, n in segs)])
                   for o, segs in zip(offsets, segments)]
    assert native == reference
    # and without the streaming exports: the same, chunk by chunk in Python
    monkeypatch.setattr(memcpy, "_XXH3_STREAM", None)
    fallback = bytearray([POISON]) * dst_size
    assert memcpy.copy_in_chunks(address(src), offsets, address(fallback), segments,
                                 memoryview(fallback)) == want
    assert fallback == reference


@pytest.mark.parametrize("counts, message", [
    ([1], "counts add up to 1 ranges; the job has 2"),
    ([1, 2], "counts add up to more than 2 ranges; the job has 2"),
    ([2**62, 2**62], "counts add up to more than 2 ranges"),
    ([3, -1], r"counts\[1\] is -1"),
])
def test_chunk_counts_that_do_not_cover_the_job_are_refused(counts, message):
    buf = bytearray([POISON]) * 8
    with pytest.raises(ValueError, match=message):
        memcpy._ranges.copy_hash_chunks(address(buf), [0, 4], address(buf), [0, 4], [1, 1],
                                        counts, memcpy._XXH3_128, PIECE, memcpy._XXH3_STREAM)
    assert buf == bytearray([POISON]) * 8


@pytest.mark.parametrize("dst_shift", range(0, 17))  # every head before the first 16-byte line
@pytest.mark.parametrize("nbytes", [HASH_PIECE + 1, 2 * HASH_PIECE + 63, 3 * HASH_PIECE - 15])
def test_streaming_stores_write_exactly_the_range_at_any_alignment(dst_shift, nbytes):
    """The streamed copy's memcpy'd head and tail and its 64-byte body meet exactly: every byte of
    the range arrives, none outside it moves, and the digest is the source's."""
    rng = random.Random(dst_shift * 7 + nbytes)
    src = bytearray(rng.randbytes(nbytes + 64))
    dst = bytearray([POISON]) * (nbytes + 128)
    src_at = rng.randrange(0, 33)
    got = memcpy._ranges.copy_hash_chunks(address(dst), [dst_shift], address(src), [src_at],
                                          [nbytes], [1], memcpy._XXH3_128, HASH_PIECE,
                                          memcpy._XXH3_STREAM)
    assert got == [xxhash.xxh3_128_digest(src[src_at:src_at + nbytes])]
    expected = bytearray([POISON]) * len(dst)
    expected[dst_shift:dst_shift + nbytes] = src[src_at:src_at + nbytes]
    assert dst == expected


@pytest.mark.parametrize("shift", [-4099, -1, 1, 4097])
def test_overlapping_ranges_are_one_memmove(shift):
    """Never a PUT's (staging and arena are two mappings), but a job whose source and destination
    overlap still moves the bytes as memmove does and hashes what it wrote."""
    rng = random.Random(shift)
    nbytes = 3 * HASH_PIECE + 5
    buf = bytearray(rng.randbytes(nbytes + 2 * 4099))
    src_at = 4099
    want = bytearray(buf)
    want[src_at + shift:src_at + shift + nbytes] = buf[src_at:src_at + nbytes]
    got = memcpy._ranges.copy_hash_chunks(address(buf), [src_at + shift], address(buf), [src_at],
                                          [nbytes], [1], memcpy._XXH3_128, HASH_PIECE,
                                          memcpy._XXH3_STREAM)
    assert buf == want
    assert got == [xxhash.xxh3_128_digest(want[src_at + shift:src_at + shift + nbytes])]


@pytest.mark.parametrize("dst_shift", [0, 1, 7, 15, 16])
@pytest.mark.parametrize("nbytes", [63, 64, 65, 4096 + 17])
def test_copy_many_streams_exactly_the_ranges_at_any_alignment(dst_shift, nbytes):
    rng = random.Random(dst_shift * 131 + nbytes)
    src = bytearray(rng.randbytes(3 * nbytes + 50))
    dst = bytearray([POISON]) * (3 * nbytes + 200)
    dsts = [dst_shift, nbytes + 40 + dst_shift, 2 * nbytes + 90 + dst_shift]
    srcs = [5, nbytes + 9, 2 * nbytes + 30]
    memcpy._ranges.copy_many(address(dst), dsts, address(src), srcs, [nbytes] * 3)
    expected = bytearray([POISON]) * len(dst)
    for d, s in zip(dsts, srcs):
        expected[d:d + nbytes] = src[s:s + nbytes]
    assert dst == expected


@pytest.mark.parametrize("shift", [-4099, -1, 1, 4097])
def test_copy_many_of_overlapping_ranges_is_memmove(shift):
    rng = random.Random(shift + 9)
    nbytes = 3 * HASH_PIECE + 5
    buf = bytearray(rng.randbytes(nbytes + 2 * 4099))
    want = bytearray(buf)
    want[4099 + shift:4099 + shift + nbytes] = buf[4099:4099 + nbytes]
    memcpy._ranges.copy_many(address(buf), [4099 + shift], address(buf), [4099], [nbytes])
    assert buf == want
