"""Host-memory copies that release the GIL, with the chunk checksum computed on the way.

``ctypes.memmove`` is a foreign call, so it runs without the GIL: copy threads really run in
parallel with the request loop and with each other. The checksum (xxh3-128, also GIL-free) is
computed piece by piece right after each piece is copied, while it is still in cache, so a PUT reads
the payload from DRAM once instead of twice.
"""

from __future__ import annotations

import ctypes

import xxhash

#: Piece size for copy-then-hash: small enough to stay in L2, large enough to amortise the calls.
PIECE_BYTES = 256 * 1024  # measured best of 64 KiB..2 MiB here

_memmove = ctypes.memmove
_digest = xxhash.xxh3_128_digest  # one-shot: the same digest as the streaming hasher


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
                   nbytes: int, dst_view: memoryview) -> list[bytes]:
    """``copy_in`` of many one-range chunks of ``nbytes`` each: ``srcs[i]`` of the source to
    ``dsts[i]`` of the destination (a PUT job of reservations held by slot: one loop, no list
    of segments per chunk); their xxh3-128s."""
    if nbytes > PIECE_BYTES:  # hashed piece by piece while in cache
        return [copy_in(src_address, src, dst_address, [(dst, nbytes)], dst_view)
                for src, dst in zip(srcs, dsts)]
    out: list[bytes] = []
    append = out.append
    for src, dst in zip(srcs, dsts):
        _memmove(dst_address + dst, src_address + src, nbytes)
        append(_digest(dst_view[dst:dst + nbytes]))
    return out


def copy_out(
    src_address: int, segments: list[tuple[int, int]], dst_address: int, dst_offset: int
) -> None:
    """Copy ``segments`` of the source, in order, into one contiguous destination range."""
    pos = dst_address + dst_offset
    for offset, length in segments:
        _memmove(pos, src_address + offset, length)
        pos += length


def copy_out_many(src_address: int, srcs: list[int], dst_address: int, dsts: list[int],
                  sizes: list[int]) -> None:
    """``copy_out`` of many one-range chunks: ``sizes[i]`` bytes at ``srcs[i]`` of the source
    to ``dsts[i]`` of the destination (a GET job of reads held by slot: one call, no list of
    segments per chunk)."""
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
