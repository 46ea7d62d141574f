"""What a tier knows about one chunk, and the states it moves through.

Lifecycle: ``reserve`` creates a PENDING entry (pages allocated, invisible to lookups) →
``commit`` makes it READY (visible, evictable) | ``abort`` frees it. A READY entry leaves by eviction
or DELETE; if a reader still copies out of it at that moment it is *doomed*: gone from the index,
its pages freed when the last reader releases it.

``ref_count`` (copies in flight) and ``pin_count`` (LOOKUP leases) are kept apart: both block
eviction, but only refs block freeing the pages of a deleted chunk.

An entry object exists only while its chunk is *hot* (PENDING, referenced, pinned, demoting, or
handed out since the index last compacted); an idle READY chunk lives as columns of its tier's
``ChunkIndex`` (``kvtierd.tiers.compact_index``) and becomes an object again when asked for.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Hashable

from kvtierd.tiers.allocator import Run


class ChunkState(enum.Enum):
    PENDING = "pending"
    READY = "ready"


@dataclass(eq=False, slots=True, init=False)
class ChunkEntry:
    ikey: Hashable  # (space, key): the index key; space = (tenant, namespace, rank)
    fingerprint: str  # layout fingerprint of the writer; a reader must present the same
    nbytes: int  # payload bytes (the pages hold ceil(nbytes / page_bytes) pages)
    runs: list[Run]  # pages holding the payload, in payload order
    owner: int  # session id of the writer while PENDING
    state: ChunkState = ChunkState.PENDING
    checksum: bytes = b""  # xxh3-128 of the payload, set at commit
    ref_count: int = 0  # copies out of the pages in flight
    pin_count: int = 0  # leases held by sessions
    doomed: bool = False  # removed from the index while referenced
    on_nvme: bool = False  # (CPU tier) the NVMe tier holds a durable copy: dropping it is free
    demoting: bool = False  # (CPU tier) being written to NVMe; readable, leaves when durable
    verified: bool = True  # False after a warm restart until a read re-checks the checksum
    slot: int = -1  # the chunk's slot in its tier's ChunkIndex; -1 once it left the index
    pages: int = field(init=False)

    # Written out rather than generated (with a __post_init__ for ``pages``): the request path
    # builds entries per item, and the extra frame was a tenth of a GET item's cost.
    def __init__(self, ikey: Hashable, fingerprint: str, nbytes: int, runs: list[Run], owner: int,
                 state: ChunkState = ChunkState.PENDING, checksum: bytes = b"",
                 ref_count: int = 0, pin_count: int = 0, doomed: bool = False,
                 on_nvme: bool = False, demoting: bool = False, verified: bool = True,
                 slot: int = -1) -> None:
        self.ikey = ikey
        self.fingerprint = fingerprint
        self.nbytes = nbytes
        self.runs = runs
        self.owner = owner
        self.state = state
        self.checksum = checksum
        self.ref_count = ref_count
        self.pin_count = pin_count
        self.doomed = doomed
        self.on_nvme = on_nvme
        self.demoting = demoting
        self.verified = verified
        self.slot = slot
        self.pages = runs[0][1] if len(runs) == 1 else sum([count for _, count in runs])

    @property
    def evictable(self) -> bool:
        return (
            self.state is ChunkState.READY
            and not self.doomed
            and self.ref_count == 0
            and self.pin_count == 0
            and not self.demoting
        )


def ready_entry(ikey: Hashable, fingerprint: str, nbytes: int, runs: list[Run], checksum: bytes,
                on_nvme: bool, verified: bool, slot: int) -> ChunkEntry:
    """An idle READY chunk's entry, built from its index columns: positional arguments (in
    field order), because the request path builds one per item and keywords cost twice as much."""
    return ChunkEntry(ikey, fingerprint, nbytes, runs, 0, ChunkState.READY, checksum, 0, 0, False,
                      on_nvme, False, verified, slot)


def pending_entry(ikey: Hashable, fingerprint: str, nbytes: int, runs: list[Run],
                  owner: int, slot: int = -1) -> ChunkEntry:
    """A new PENDING chunk's entry (a PUT item's reservation), positional like ``ready_entry``."""
    return ChunkEntry(ikey, fingerprint, nbytes, runs, owner, ChunkState.PENDING, b"", 0, 0,
                      False, False, False, True, slot)


def tenant_of(ikey: Hashable) -> str:
    """The tenant part of an index key ``((tenant, namespace, rank), key)``."""
    return ikey[0][0]  # type: ignore[index]


def segments(runs: list[Run], nbytes: int, page_bytes: int) -> list[tuple[int, int]]:
    """Byte ranges ``(offset, length)`` of a payload laid over ``runs``, in payload order."""
    out: list[tuple[int, int]] = []
    left = nbytes
    for start, count in runs:
        if left <= 0:
            break
        length = min(count * page_bytes, left)
        out.append((start * page_bytes, length))
        left -= length
    return out
