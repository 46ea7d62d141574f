"""Host-memory copies that release the GIL, with the chunk checksum computed on the way.

``ctypes.memmove`` is a foreign call, so it runs without the GIL: copy threads really run in
parallel with the request loop and with each other. The checksum (xxh3-128, also GIL-free) is
computed piece by piece right after each piece is copied, while it is still in cache, so a PUT reads
the payload from DRAM once instead of twice.

A job of many one-range chunks (``copy_in_ranges``, ``copy_out_many``) goes to the compiled
``kvtierd.copy._ranges`` where it was built: the whole job in one call that releases the GIL once,
instead of one release (two for a PUT: memmove, then xxh3) per chunk. There a PUT's chunks, of
one range or several (a fragmented arena), are copied and hashed by ``HASH_PIECE_BYTES`` pieces
with xxHash's streaming functions, each piece hashed from L1 (``copy_in_chunks``: one GIL release
per job instead of two per piece; two copy threads PUTting 2 MiB chunks fought over the GIL 16
times a chunk). A GET job's ranges are written with streaming stores as well (``copy_out_many``):
the client reads staging next, from its own core. ``NATIVE`` says which runs.
"""

from __future__ import annotations

import ctypes
import os

import xxhash

from kvtierd import xxhash_exports

#: Piece size for copy-then-hash in Python: small enough to stay in L2, large enough to amortise
#: the calls.
PIECE_BYTES = 256 * 1024  # measured best of 64 KiB..2 MiB here

#: Piece size of the compiled copy-and-hash (no Python per piece): each 4 KiB piece is copied with
#: streaming stores and hashed from the source's lines the copy just read into L1. Measured here,
#: copying 64 MiB of chunks between two buffers, against one memmove per chunk then one hash of its
#: destination: with memmoved pieces 16 KiB chunks 0.87x of a bare memmove against 0.84x, 64 KiB
#: 0.91-0.92x against 0.82x, 256 KiB 0.88-0.95x against 0.75-0.81x, 2 MiB 0.91x against 0.85x
#: (256 KiB pieces); with streamed pieces 1.0-1.2x of a bare memmove; 2 KiB pieces fell to
#: 0.55-0.6x (xxHash's streaming cost per update).
HASH_PIECE_BYTES = 4096

_memmove = ctypes.memmove
_digest = xxhash.xxh3_128_digest  # one-shot: the same digest as the streaming hasher


#: The ``xxhash`` extension's exports tried, in order: the one that picks the CPU's widest vector
#: unit at run time (AVX2 here: a 64 KiB copy-and-hash 8.0-9.0 against 6.7-7.2 GB/s), then the
#: one compiled for the baseline instruction set.
XXH3_128_NAMES = ("XXH3_128bits_dispatch", "XXH3_128bits")


def _xxh3_128_address(names: tuple[str, ...] = XXH3_128_NAMES) -> int | None:
    """The address of the first of ``names`` that the ``xxhash`` package's extension exports and
    that gives ``xxh3_128_digest``'s digests through ``_ranges`` (checked on random data of the
    lengths where xxh3 changes its method); else None, and PUT jobs hash in Python."""
    try:
        from kvtierd.copy import _ranges  # noqa: PLC0415 (optional: absent without a compiler)
    except ImportError:
        return None
    lengths = [0, 1, 3, 4, 8, 9, 16, 17, 128, 129, 240, 241, 1024, 4096, 16384 + 5, PIECE_BYTES]
    src = bytearray(os.urandom(sum(lengths)))
    dst = bytearray(len(src))
    offsets = [sum(lengths[:i]) for i in range(len(lengths))]
    src_address = ctypes.addressof(ctypes.c_char.from_buffer(src))
    dst_address = ctypes.addressof(ctypes.c_char.from_buffer(dst))
    want = [_digest(src[offset:offset + length]) for offset, length in zip(offsets, lengths)]
    for address in xxhash_exports.addresses(names):
        if all(
                _ranges.copy_hash_many(dst_address, [offset], src_address, [offset], length,
                                       address) == [digest]
                for offset, length, digest in zip(offsets, lengths, want)):
            return address
    return None


#: xxHash's streaming functions for ranges longer than a piece, in ``_ranges``' order (create,
#: free, reset, update, digest); of the updates, the one that picks the widest vector unit first.
XXH3_STREAM_NAMES = (("XXH3_createState",), ("XXH3_freeState",), ("XXH3_128bits_reset",),
                     ("XXH3_128bits_update_dispatch", "XXH3_128bits_update"),
                     ("XXH3_128bits_digest",))


def _xxh3_stream(one_shot: int | None,
                 names: tuple[tuple[str, ...], ...] = XXH3_STREAM_NAMES) -> tuple[int, ...] | None:
    """The addresses ``_ranges.copy_hash_chunks`` streams ranges longer than a piece with, if
    the extension exports them and they give ``xxh3_128_digest``'s digests (checked on lengths
    around and across piece boundaries, and a chunk of two ranges); else None, and such chunks
    are hashed in Python."""
    if one_shot is None:
        return None
    *fixed, updates, digest = names
    found = [next(xxhash_exports.addresses(name), None) for name in (*fixed, digest)]
    if None in found:
        return None
    lengths = [0, 1, HASH_PIECE_BYTES, HASH_PIECE_BYTES + 1, 2 * HASH_PIECE_BYTES,
               3 * HASH_PIECE_BYTES + 17, PIECE_BYTES + 3, 5]
    counts = [1, 1, 1, 1, 1, 1, 2]  # the last chunk: two ranges, hashed as one payload
    src = bytearray(os.urandom(sum(lengths)))
    dst = bytearray(len(src))
    offsets = [sum(lengths[:i]) for i in range(len(lengths))]
    ends = [sum(counts[:j + 1]) for j in range(len(counts))]
    want = [_digest(src[offsets[end - count]:offsets[end - 1] + lengths[end - 1]])
            for count, end in zip(counts, ends)]
    src_address = ctypes.addressof(ctypes.c_char.from_buffer(src))
    dst_address = ctypes.addressof(ctypes.c_char.from_buffer(dst))
    for update in xxhash_exports.addresses(updates):
        stream = (*found[:3], update, found[3])
        if (_ranges.copy_hash_chunks(dst_address, offsets, src_address, offsets, lengths, counts,
                                     one_shot, HASH_PIECE_BYTES, stream) == want
                and dst == src):
            return stream
    return None


try:
    from kvtierd.copy import _ranges
except ImportError:  # built without a C compiler (setup.py: the extension is optional)
    _ranges = None
_XXH3_128 = _xxh3_128_address() if _ranges is not None else None
_XXH3_STREAM = _xxh3_stream(_XXH3_128)


def _native(ranges: object, one_shot: int | None, stream: tuple[int, ...] | None) -> str:
    """Which copies PUT and GET jobs run, for the daemon's start-up line."""
    if ranges is None:
        return "ctypes"  # a memmove (and a hash) per chunk
    if one_shot is None:
        return "compiled copies, xxh3 in Python"
    if stream is None:  # xxHash's streaming exports missing or refused
        return "compiled copies and xxh3, long or multi-run chunks hashed in Python"
    return "compiled copies and xxh3"  # one GIL release per job


NATIVE = _native(_ranges, _XXH3_128, _XXH3_STREAM)


def copy_in(
    src_address: int, src_offset: int, dst_address: int, segments: list[tuple[int, int]],
    dst_view: memoryview,
) -> bytes:
    """Copy a contiguous source range into ``segments`` of the destination; return its xxh3-128.

    ``segments`` are ``(offset, length)`` ranges of the destination in payload order;
    ``dst_view`` is the destination as a memoryview (for hashing without another copy).
    """
    if len(segments) == 1 and segments[0][1] <= PIECE_BYTES:
        # A small chunk in one run (most of them, below page-sized runs): one memmove and one
        # one-shot hash, no hasher object; a third of the Python work per 16 KiB item.
        offset, length = segments[0]
        _memmove(dst_address + offset, src_address + src_offset, length)
        return _digest(dst_view[offset : offset + length])
    if _XXH3_STREAM is not None:  # piece by piece in one C call
        return copy_in_chunks(src_address, [src_offset], dst_address, [segments], dst_view)[0]
    return copy_in_python(src_address, src_offset, dst_address, segments, dst_view)


def copy_in_chunks(src_address: int, src_offsets: list[int], dst_address: int,
                   segments: list[list[tuple[int, int]]], dst_view: memoryview) -> list[bytes]:
    """``copy_in`` of many chunks (chunk ``j``: contiguous source at ``src_offsets[j]`` into the
    destination ranges ``segments[j]``): one compiled call for the whole job where the streaming
    exports checked out (a PUT job into a fragmented arena, whose chunks are several runs each)."""
    if _XXH3_STREAM is None:
        return [copy_in(src_address, offset, dst_address, segs, dst_view)
                for offset, segs in zip(src_offsets, segments)]
    dsts: list[int] = []
    srcs: list[int] = []
    sizes: list[int] = []
    for offset, segs in zip(src_offsets, segments):
        for dst, length in segs:
            dsts.append(dst)
            srcs.append(offset)
            sizes.append(length)
            offset += length
    return _ranges.copy_hash_chunks(dst_address, dsts, src_address, srcs, sizes,
                                    list(map(len, segments)), _XXH3_128, HASH_PIECE_BYTES,
                                    _XXH3_STREAM)


def copy_in_python(src_address: int, src_offset: int, dst_address: int,
                   segments: list[tuple[int, int]], dst_view: memoryview) -> bytes:
    """``copy_in`` by pieces of at most PIECE_BYTES, a memmove and a hasher update each (without
    the streaming exports; and the reference the compiled form is tested against)."""
    hasher = xxhash.xxh3_128()
    pos = src_address + src_offset
    for offset, length in segments:
        done = 0
        while done < length:
            piece = min(PIECE_BYTES, length - done)
            _memmove(dst_address + offset + done, pos, piece)
            hasher.update(dst_view[offset + done : offset + done + piece])
            pos += piece
            done += piece
    return hasher.digest()


def copy_in_ranges(src_address: int, srcs: list[int], dst_address: int, dsts: list[int],
                   sizes: int | list[int], dst_view: memoryview) -> list[bytes]:
    """``copy_in`` of many one-range chunks: ``srcs[i]`` of the source to ``dsts[i]`` of the
    destination, ``sizes`` bytes each (an int) or ``sizes[i]`` (a list); their xxh3-128s. A PUT
    job of reservations held by slot, or of entries whose pages are one run: one call, no list
    of segments per chunk."""
    if _XXH3_STREAM is not None:  # copied and hashed by HASH_PIECE_BYTES pieces, one call
        count = len(srcs)
        return _ranges.copy_hash_chunks(dst_address, dsts, src_address, srcs,
                                        [sizes] * count if type(sizes) is int else sizes,
                                        [1] * count, _XXH3_128, HASH_PIECE_BYTES, _XXH3_STREAM)
    if (sizes if type(sizes) is int else max(sizes, default=0)) > PIECE_BYTES:
        each = [sizes] * len(srcs) if type(sizes) is int else sizes
        return copy_in_chunks(src_address, srcs, dst_address,  # hashed piece by piece
                              [[(dst, nbytes)] for dst, nbytes in zip(dsts, each)], dst_view)
    if _XXH3_128 is not None:
        return _ranges.copy_hash_many(dst_address, dsts, src_address, srcs, sizes, _XXH3_128)
    return copy_in_ranges_ctypes(src_address, srcs, dst_address, dsts, sizes, dst_view)


def copy_in_ranges_ctypes(src_address: int, srcs: list[int], dst_address: int, dsts: list[int],
                          sizes: int | list[int], dst_view: memoryview) -> list[bytes]:
    """``copy_in_ranges`` of chunks of at most PIECE_BYTES, a memmove and a hash call each (where
    ``_ranges`` was not built or its xxh3 did not check out; and the reference it is tested
    against)."""
    out: list[bytes] = []
    append = out.append
    if type(sizes) is int:
        nbytes = sizes
        for src, dst in zip(srcs, dsts):
            _memmove(dst_address + dst, src_address + src, nbytes)
            append(_digest(dst_view[dst:dst + nbytes]))
        return out
    for src, dst, nbytes in zip(srcs, dsts, sizes):
        _memmove(dst_address + dst, src_address + src, nbytes)
        append(_digest(dst_view[dst:dst + nbytes]))
    return out


def copy_out_many(src_address: int, srcs: list[int], dst_address: int, dsts: list[int],
                  sizes: list[int]) -> None:
    """A GET job's copies: ``sizes[i]`` bytes at ``srcs[i]`` of the source to ``dsts[i]`` of the
    destination (one range per chunk held by slot, or every range of chunks with entries), in one
    call."""
    if _ranges is not None:
        _ranges.copy_many(dst_address, dsts, src_address, srcs, sizes)
    else:
        copy_out_many_ctypes(src_address, srcs, dst_address, dsts, sizes)


def copy_out_many_ctypes(src_address: int, srcs: list[int], dst_address: int, dsts: list[int],
                         sizes: list[int]) -> None:
    """``copy_out_many`` with one ctypes memmove per chunk (without ``_ranges``; the reference
    it is tested against)."""
    for src, dst, nbytes in zip(srcs, dsts, sizes):
        _memmove(dst_address + dst, src_address + src, nbytes)


def checksum(view: memoryview, segments: list[tuple[int, int]]) -> bytes:
    if len(segments) == 1:
        offset, length = segments[0]
        return _digest(view[offset : offset + length])
    hasher = xxhash.xxh3_128()
    for offset, length in segments:
        hasher.update(view[offset : offset + length])
    return hasher.digest()
