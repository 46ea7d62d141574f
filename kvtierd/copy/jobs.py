"""The copy jobs of PUT and GET batches: many chunks per job, run on a copy thread.

A job is a list of ``(item index, entry, where)``: ``where`` is the chunk's offset in the session's
staging buffer, or (an inline session, no staging) its payload frame / reply buffer. One job per
few MiB of a batch, not one per chunk: submitting, waking the loop and completing cost the same for
one 16 KiB chunk as for a thousand. The loop thread builds and completes jobs; these functions only
move bytes and hash them (memmove and xxh3 release the GIL), and never touch tier state.
"""

from __future__ import annotations

from typing import Any, Callable

from kvtierd.copy import memcpy
from kvtierd.tiers.chunk import ChunkEntry

Job = list[tuple[int, ChunkEntry, Any]]
Segments = Callable[[ChunkEntry], list[tuple[int, int]]]


def copy_in(staging: Any, arena: Any, segments: Segments, job: Job) -> list[bytes]:
    """Staging (or payload frames) → the entries' arena pages; the xxh3-128 of each chunk."""
    if staging is None:
        return [_frame_in(memoryview(frame), arena, segments(entry)) for _, entry, frame in job]
    segs = [segments(entry) for _, entry, _ in job]
    if all(len(seg) == 1 for seg in segs):  # each chunk one run of pages: one call for the job
        runs = [seg[0] for seg in segs]
        return staging.copy_in_ranges(arena, [offset for _, _, offset in job],
                                      [run[0] for run in runs], [run[1] for run in runs])
    return staging.copy_in_chunks(arena, [offset for _, _, offset in job], segs)


def copy_out(staging: Any, arena: Any, segments: Segments, job: Job) -> set[int]:
    """The entries' arena pages → staging (or reply buffers); return the job positions whose
    chunk failed its first-read check (after a warm restart) and was not copied. Into staging,
    every range of every chunk (several per chunk in a fragmented arena) is one
    ``copy_out_many`` call: one GIL release for the job, not one per range."""
    view = arena.view
    bad: set[int] = set()
    srcs: list[int] = []
    dsts: list[int] = []
    sizes: list[int] = []
    for pos, (_, entry, target) in enumerate(job):
        segs = segments(entry)
        if not entry.verified and memcpy.checksum(view, segs) != entry.checksum:
            bad.add(pos)
            continue
        if staging is None:
            _frame_out(arena, segs, target)
            continue
        for offset, length in segs:
            srcs.append(offset)
            dsts.append(target)
            sizes.append(length)
            target += length
    if srcs:
        staging.copy_out_many(arena, srcs, dsts, sizes)
    return bad


def copy_writes_in(staging: Any, arena: Any, writes: Any) -> list[bytes]:
    """A PUT job of reservations held by slot (``kvtierd.server.batch.SlotWrites``: byte
    ranges) from staging; the xxh3-128 of each chunk."""
    return staging.copy_in_ranges(arena, writes.src, writes.dst, writes.nbytes)


def copy_reads_out(staging: Any, arena: Any, reads: Any) -> None:
    """A GET job of chunks held by slot (``kvtierd.server.batch.SlotReads``: byte ranges,
    already verified) → staging."""
    staging.copy_out_many(arena, reads.src, reads.dst, reads.sizes)


def _frame_in(payload: memoryview, arena: Any, segs: list[tuple[int, int]]) -> bytes:
    pos = 0
    for offset, length in segs:
        arena.view[offset : offset + length] = payload[pos : pos + length]
        pos += length
    return memcpy.checksum(arena.view, segs)


def _frame_out(arena: Any, segs: list[tuple[int, int]], target: bytearray) -> None:
    pos = 0
    for offset, length in segs:
        target[pos : pos + length] = arena.view[offset : offset + length]
        pos += length
