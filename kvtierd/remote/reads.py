"""How a remote read job lays out its objects: where each lands, and how the job is cut into
Mooncake calls (``RemoteTier.read_batch_job``)."""

from __future__ import annotations

from dataclasses import dataclass

from kvtierd.remote.objects import HEADER_BYTES
from kvtierd.tiers.allocator import Run
from kvtierd.tiers.chunk import ChunkEntry

#: Bytes one ``batch_get_into_multi_buffers`` of a read job carries at most (besides at most
#: ``max_batch`` objects). A job's calls are verified on a second thread while the next call is on
#: the wire, so the xxh3-128 of all but the last call can hide behind the transfers; as one call
#: (a GET of 256 MiB of 256 KiB chunks was one batch) the check could only follow the whole
#: transfer. On the 2-core VM this measured no change beyond the noise (fetch 0.65-1.00x of
#: Mooncake's raw gets either way; its TCP transfer over loopback spends about half of its CPU in
#: the kernel, which the hashing competes with); it is for transfers that leave the CPU free (RDMA).
READ_CALL_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class Read:
    """One object of a read job: its name, the chunk, and where its payload lands."""

    name: str
    entry: ChunkEntry
    segments: list[tuple[int, int]]  # arena view byte ranges, payload order
    buffers: list[tuple[int, int]]  # the same as registered addresses
    inline: bool  # the target's pages have room for the header right after the payload


def read_calls(reads: list[Read], max_objects: int, max_bytes: int
               ) -> list[tuple[int, list[Read]]]:
    """``reads`` in order, cut into calls of at most ``max_objects`` objects and, where more
    than one object, at most ``max_bytes`` payload bytes; each with its first read's index."""
    calls: list[tuple[int, list[Read]]] = []
    start, size = 0, 0
    for i, read in enumerate(reads):
        nbytes = read.entry.nbytes
        if i > start and (i - start == max_objects or size + nbytes > max_bytes):
            calls.append((start, reads[start:i]))
            start, size = i, 0
        size += nbytes
    if start < len(reads):
        calls.append((start, reads[start:]))
    return calls


def header_fits_after(runs: list[Run], segs: list[tuple[int, int]], page_bytes: int) -> bool:
    """Whether the pages ``runs`` hold ``HEADER_BYTES`` more right after the payload's last
    segment (so a read can land the object's trailing header there, in the same buffer)."""
    if not segs:
        return False
    offset, length = segs[-1]
    end = offset + length
    for start, count in runs:
        run_end = (start + count) * page_bytes
        if start * page_bytes < end <= run_end:
            return run_end - end >= HEADER_BYTES
    return False
