"""Cascading: a chunk a lower tier evicts goes on to the next tier that takes what leaves it.

Why: with ``remote_publish = "on-evict"`` the remote tier is to get what leaves the local tiers,
and what leaves NVMe (full) would otherwise be lost. A victim is held (its NVMe pages stay until it
is read), read into *bounce pages* (verified against its checksum), written to the tier below in
one write job per batch, then let go (``kvtierd.server.chain_io`` settles each one).

The bounce pages are a slice of the arena set aside when the chain is built (``CASCADE_BYTES``, at
most 1/16 of the arena, only when some tier has an ``on-evict`` tier below it): a cascade never
takes pages from a PUT or a promotion, and needs no index entry in the arena.

While the slice is in use, a victim that would cascade stays where it is (``NO_ROOM``: the tier
stops evicting and counts ``evictions_deferred``): the reservation that needed its room fails,
and the chain writes that chunk to the tier below itself, so pressure loses neither. A victim is
dropped, as one evicted from the last tier is, only when no tier below can take it: none usable
(down, or its circuit breaker open), an admission threshold on it (its reads were not counted
below the arena), or it holds the chunk already.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from kvtierd.tiers.allocator import PageAllocator, Run
from kvtierd.tiers.chunk import ChunkEntry, segments
from kvtierd.tiers.cpu import CpuTier
from kvtierd.tiers.lower import Publish

if TYPE_CHECKING:
    from kvtierd.server.chain import Link, TierChain

log = logging.getLogger(__name__)

#: Arena bytes set aside for chunks cascading between lower tiers (at most 1/16 of the arena).
CASCADE_BYTES = 64 * 1024**2
#: ``hold``'s answer for a victim that is to cascade while the bounce pages are in use.
NO_ROOM = object()


@dataclass(eq=False)
class Cascade:
    """A chunk evicted from ``source_link``'s tier on its way to a tier further down."""

    source_link: Link
    source: ChunkEntry  # the evicted copy (acquired: its pages stay until the read is done)
    bounce: list[Run]  # arena pages of the set-aside slice it is read into
    target: ChunkEntry  # the reservation below (PENDING)


class BouncePages:
    """The arena slice set aside for cascades, handed out as runs of arena pages."""

    def __init__(self, run: Run) -> None:
        self.start, self.pages = run
        self.allocator = PageAllocator(self.pages)

    def take(self, pages: int) -> list[Run] | None:
        runs = self.allocator.allocate(pages)
        return None if runs is None else [(self.start + s, n) for s, n in runs]

    def give_back(self, runs: list[Run]) -> None:
        self.allocator.free([(s - self.start, n) for s, n in runs])


def set_aside(cpu: CpuTier, links: list[Link], nbytes: int) -> BouncePages | None:
    """The bounce slice, when some tier has an ``on-evict`` tier below it to cascade to."""
    if not any(later.policy.when is Publish.ON_EVICT
               for i, _ in enumerate(links) for later in links[i + 1:]):
        return None
    pages = min(nbytes, cpu.arena.nbytes // 16) // cpu.page_bytes
    if not pages:
        log.info("chunks evicted from one tier are not cascaded to the next (%s)",
                 "cascade_bytes 0" if not nbytes else "the arena has under 16 pages")
        return None
    run = cpu.set_aside(pages)
    if run is None:
        log.warning("no %d arena pages free to set aside: chunks evicted from one tier are "
                    "not cascaded to the next", pages)
        return None
    log.info("%d arena pages set aside to cascade chunks evicted from one tier to the next",
             pages)
    return BouncePages(run)


def hold(chain: TierChain, link: Link, entry: ChunkEntry) -> tuple[Link, Cascade] | object | None:
    """``link``'s tier evicts ``entry``: held (acquired) with bounce pages and a reservation in
    the first tier below that takes what leaves the tiers above it, if any can. Returns the link
    below and the cascade to queue there; None: nothing below takes it (drop it; counted in
    ``kvtierd_evictions_dropped_total`` with the reason when a tier below was meant to);
    ``NO_ROOM``: it is to cascade but the bounce pages are in use (keep it for now)."""
    if chain.bounce is None:
        return None
    takers = [other for other in chain.links[chain.links.index(link) + 1:]
              if other.policy.when is Publish.ON_EVICT]
    if not takers:
        return None  # a plain eviction: no tier below is to get what leaves this one
    below = next((other for other in takers if chain.usable(other)), None)
    if below is None:
        return _dropped(chain, link, "below_unavailable")
    if below.policy.after_reads:  # its reads were not counted below the arena
        return _dropped(chain, link, "admission")
    if below.tier.holds(entry.ikey, entry.checksum):
        return None  # a copy is below already: nothing is lost
    pages = chain.cpu.pages_for(entry.nbytes)
    bounce = chain.bounce.take(pages)
    if bounce is None:  # the slice is in use: the victim stays until it frees up
        return NO_ROOM if chain.bounce.pages >= pages else _dropped(chain, link, "too_large")
    target = below.tier.reserve(entry.ikey, entry.fingerprint, entry.nbytes, entry.checksum)
    if target is None:
        chain.bounce.give_back(bounce)
        return _dropped(chain, link, "no_room_below")
    link.tier.acquire(entry)
    return below, Cascade(link, entry, bounce, target)


def _dropped(chain: TierChain, link: Link, reason: str) -> None:
    """A victim meant to cascade that no tier below will hold: counted, since it is now gone
    from every tier (what an operator sizing ``on-evict`` wants to see)."""
    chain.metrics.evictions_dropped.labels(link.name, reason).inc()
    return None


def job(cpu: CpuTier, link: Link, batch: list[Cascade]) -> Callable[[], list[Any]]:
    """Read each evicted chunk into its bounce pages (verified), then write the good ones to
    ``link``'s tier in one write job; per chunk, None (written) or what went wrong."""
    arena, reads, writes = cpu.arena, [], []
    for c in batch:
        segs = segments(c.bounce, c.target.nbytes, cpu.page_bytes)
        reads.append(c.source_link.tier.read_job(c.source, arena, c.bounce, segs))
        writes.append((c.target, c.bounce))

    def run() -> list[Any]:
        out: list[Any] = []
        for read in reads:
            try:
                read()
                out.append(None)
            except Exception as exc:  # this chunk's fault (unreadable, corrupt)
                out.append(exc)
        good = [w for w, o in zip(writes, out) if o is None]
        if good:
            link.tier.write_job(good, arena)()  # raises: every chunk of it failed
        return out

    return run
