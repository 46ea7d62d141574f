"""The tier chain: the arena (CPU tier) above an ordered list of lower tiers (nvme → remote).

Everything that moves chunks between tiers is written here once, for any ``LowerTier``
(``kvtierd.tiers.lower``, whose docstring is the contract and the publishing rules):

* **Lookups** go down the chain, skipping tiers that are unavailable; a lower tier that cannot tell
  without I/O (remote) gets one batched existence check per LOOKUP (``check``).
* **Demotion** (a CPU victim): the chunk stays READY and readable in the arena, marked
  ``demoting`` (not evictable, one ref held by the write), until its copy below is durable; then it
  leaves the arena. A victim some tier already holds leaves at once. Under sustained writes the
  next round starts as soon as the parked PUTs take a finished round's pages
  (``chain_io.next_round``), so the tier below writes one round while another syncs.
* **Publishing on commit** (``on-commit``, NVMe's write-through): every commit also starts a write;
  the arena copy stays. With an admission filter (``after_reads``) it starts at the N-th read.
* **Cascading on eviction**: a chunk a lower tier evicts (NVMe, full) goes on to the first tier
  below it whose policy is ``on-evict``, through bounce pages set aside in the arena
  (``kvtierd.server.chain_cascade``). While those are in use the victim stays, and the chunk that
  needed its room goes below itself; a victim no tier below can take is dropped.
* **Promotion**: a GET hit below reads the chunk into reserved arena pages (the caller parks items
  while the arena is full, as for any promotion), verified by the tier, then commits it. The
  promotions of one loop iteration (a GET batch, a parked retry) are queued per tier and flushed
  with the writes as few read jobs (``LowerTier.read_batch_job``, ``READ_JOB_BYTES``): batched
  remote gets instead of one round trip and one completion per chunk.
* **Faults**: a failed write drops that chunk from the tier (and, for a demotion, from the arena,
  which it was leaving anyway); a failed or corrupt read drops the copy below and the reader gets a
  miss; a job raising ``TierUnavailable`` opens the tier's circuit for its ``retry_s`` (skipped by
  lookups, reads and writes meanwhile), after which a probe job off the request path decides
  (``kvtierd.server.circuit``). Each raises a metric (``tier``
  label) and a log line; the daemon keeps serving.

Runs on the loop thread; every byte transfer is a job on the I/O engine (its own thread pool, so a
slow disk or network never stalls the request loop or the memcpy threads). Job completions are in
``kvtierd.server.chain_io``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Hashable, Sequence, TypeVar

from kvtierd.copy.engine import CopyEngine
from kvtierd.metrics import DaemonMetrics
from kvtierd.protocol import Status, Tier
from kvtierd.server import chain_cascade, chain_io
from kvtierd.server.chain_cascade import Cascade
from kvtierd.server.circuit import Circuit
from kvtierd.tiers.chunk import ChunkEntry
from kvtierd.tiers.cpu import CpuTier
from kvtierd.tiers.lower import MISS_ANSWER as _MISS_ANSWER
from kvtierd.tiers.lower import LowerTier, Publish, PublishPolicy

log = logging.getLogger(__name__)

#: Chunks cascading from one lower tier to the next are written in jobs of about this many bytes
#: (demotions and publishing: ``LowerTier.write_job_bytes``, the tier's own).
WRITE_JOB_BYTES = 32 * 1024**2
#: Promotions queued during one loop iteration are read in jobs spread over the tier's I/O threads
#: (a GET of a few chunks still reads them in parallel) of at most this many bytes (a GET waits
#: for its slowest job). A tier with batched reads (``LowerTier.batched_reads``) gets one job.
READ_JOB_BYTES = 16 * 1024**2
#: Existence checks in flight at once; past it a LOOKUP answers from what the tiers know.
MAX_CHECKS_IN_FLIGHT = 64
WRITE_KINDS = ("demote", "write_through")
T = TypeVar("T")
#: ``lookup_below_many``'s answer for a key every lower tier missed (one object: a batch's
#: misses are counted in C).
MISSED: tuple[Status, Tier, ChunkEntry | None] = (Status.MISS, Tier.NONE, None)


def split(items: list[T], nbytes: Callable[[T], int], per_job: int) -> list[list[T]]:
    """``items`` in order, cut into jobs of about ``per_job`` bytes (a job ends with the item
    that reaches it; one item larger than that is a job of its own)."""
    jobs: list[list[T]] = []
    batch: list[T] = []
    size = 0
    for item in items:
        batch.append(item)
        size += nbytes(item)
        if size >= per_job:
            jobs.append(batch)
            batch, size = [], 0
    if batch:
        jobs.append(batch)
    return jobs


class ChainEvents:
    """Where "chunk now durable in tier X" and "chunk dropped from tier X" happen, for every tier
    (``tier`` is the metric label: cpu, nvme, remote). KV events subscribe by replacing these."""

    def stored(self, tier: str, entry: ChunkEntry) -> None:
        return None

    def dropped(self, tier: str, entry: ChunkEntry) -> None:
        return None


@dataclass(eq=False)
class Promotion:
    """One GET item's read from a lower tier into reserved arena pages."""

    source: ChunkEntry  # the copy below (acquired until the read completes)
    target: ChunkEntry  # the arena target (PENDING)
    done: Callable[[bool, str], None]  # the waiting GET item


@dataclass(eq=False)
class Link:
    """One lower tier in the chain, with its publishing policy and circuit state."""

    tier: LowerTier
    policy: PublishPolicy
    engine: CopyEngine  # where its jobs run: the shared I/O pool or its own (LowerTier.io_threads)
    circuit: Circuit = field(init=False)  # set by the chain: whether it may be asked now
    queued: dict[str, list[tuple[ChunkEntry, ChunkEntry]]] = field(
        default_factory=lambda: {kind: [] for kind in WRITE_KINDS})  # (cpu entry, target)
    reads: list[Promotion] = field(default_factory=list)  # promotions waiting for flush
    cascades: list[Cascade] = field(default_factory=list)  # evicted above, bound here, queued

    @property
    def name(self) -> str:
        return self.tier.name


@dataclass(eq=False)
class IoJob:
    kind: str  # "demote" | "write_through" | "promote" | "cascade" | "delete" | "exists" | "probe"
    link: Link
    reads: list[Promotion] | None = None  # promote: the items of one read job
    cascades: list[Cascade] | None = None  # cascade: chunks evicted above, written to ``link``
    writes: list[tuple[ChunkEntry, ChunkEntry]] | None = None  # (cpu entry, target below)
    deleted: list[ChunkEntry] | None = None
    keys: list[Hashable] | None = None  # exists: the keys asked about
    fingerprint: str = ""
    done: Callable[..., None] | None = None  # exists: the waiting LOOKUP
    started: float = field(default_factory=time.perf_counter)


class TierChain:
    def __init__(self, cpu: CpuTier, lower: Sequence[tuple[LowerTier, PublishPolicy]],
                 engine: CopyEngine, metrics: DaemonMetrics,
                 clock: Callable[[], float] = time.monotonic,
                 cascade_bytes: int = chain_cascade.CASCADE_BYTES) -> None:
        self.cpu = cpu
        self.engine = engine
        self._own_engines: list[CopyEngine] = []  # per-tier pools, closed with the chain
        self.links = []
        for tier, policy in lower:
            if tier.io_threads:
                self._own_engines.append(CopyEngine(tier.io_threads, inline_bytes=-1))
            self.links.append(Link(tier, policy, self._own_engines[-1] if tier.io_threads
                                   else engine))
        self.metrics = metrics
        self.clock = clock
        self.events = ChainEvents()
        self.on_space: Callable[[], None] = lambda: None  # set by the data ops (parked items)
        # Reads of arena chunks, kept only while some tier filters admission by reads.
        self._admission = self.counts_reads = any(link.policy.after_reads for link in self.links)
        # What ``after_commit`` does beyond events: write each chunk to such a tier at commit.
        self.publishes_at_commit = any(link.policy.when is Publish.ON_COMMIT
                                       and not link.policy.after_reads for link in self.links)
        self._reads: Counter[Hashable] = Counter()
        self.checks_in_flight = 0
        for link in self.links:
            link.tier.on_drop = partial(self._lower_dropped, link)
            link.tier.on_evict = partial(self._lower_evicted, link)
            link.circuit = Circuit(link.tier, metrics, clock, partial(self._submit_probe, link))
        if self.links:
            cpu.demoter = self.demote
        cpu.on_evict = self._cpu_evicted
        self.bounce = chain_cascade.set_aside(cpu, self.links, cascade_bytes)

    def _submit_probe(self, link: Link, job: Any) -> None:
        self._submit(IoJob("probe", link), job, 0)

    @property
    def checks_existence(self) -> bool:
        """Whether some lower tier needs existence checks for keys it does not know (remote)."""
        return any(link.tier.checks_existence for link in self.links)

    @property
    def engines(self) -> list[CopyEngine]:
        """Every I/O pool whose completions the loop must drain (``on_io_done``)."""
        return [self.engine, *self._own_engines]

    @property
    def lower(self) -> list[LowerTier]:
        return [link.tier for link in self.links]

    def link(self, tier: Tier) -> Link:
        for link in self.links:
            if link.tier.tier is tier:
                return link
        raise KeyError(f"no {tier.name} tier in the chain")

    # -- health (each tier's circuit: ``kvtierd.server.circuit``) --------------------------------
    def usable(self, link: Link) -> bool:
        """Whether the tier may be asked now: it says it is available and its circuit is closed."""
        return link.circuit.usable()

    def probe(self) -> None:
        """Start the probe of each tripped tier whose ``retry_s`` has passed (called every loop
        iteration and tick): off the request path, on the tier's engine."""
        for link in self.links:
            link.circuit.probe()

    def probed(self, link: Link, error: BaseException | None) -> None:
        """A probe answered (``chain_io``)."""
        link.circuit.probed(error)

    def trip(self, link: Link, error: BaseException) -> None:
        """A job found the tier unreachable."""
        link.circuit.trip(error)

    # -- lookups across tiers ----------------------------------------------------------------------
    def lookup(self, ikey: Any, fingerprint: str) -> tuple[Status, Tier, ChunkEntry | None]:
        status, entry = self.cpu.lookup(ikey, fingerprint)
        if entry is not None or status is Status.LAYOUT_MISMATCH:
            return status, Tier.CPU, entry
        return self.lookup_below(ikey, fingerprint)

    def lookup_below(self, ikey: Any, fingerprint: str
                     ) -> tuple[Status, Tier, ChunkEntry | None]:
        """``lookup`` in the usable lower tiers only (the arena already missed)."""
        for link in self.links:
            if not self.usable(link):
                continue
            status, entry = link.tier.lookup(ikey, fingerprint)
            if entry is not None or status is Status.LAYOUT_MISMATCH:
                return status, link.tier.tier, entry
        return Status.MISS, Tier.NONE, None

    def lookup_below_many(self, ikeys: Sequence[Hashable], fingerprint: str, entries: bool = True
                          ) -> list[tuple[Status, Tier, ChunkEntry | None]]:
        """``lookup_below`` of each key, tier by tier: each usable lower tier is asked once
        (``LowerTier.lookup_many``) for the keys the tiers above it missed, not each tier per
        key (a 1024-key LOOKUP's misses cost a chain walk each). Same answers, touches and
        counts. ``entries=False``: a hit may come as ``(OK, tier, None)`` (nothing to lease)."""
        out: list[tuple[Status, Tier, ChunkEntry | None]] = [MISSED] * len(ikeys)
        todo = list(range(len(ikeys)))
        for link in self.links:
            if not todo:
                break
            if not self.usable(link):
                continue
            answers = link.tier.lookup_many([ikeys[i] for i in todo] if len(todo) < len(ikeys)
                                            else ikeys, fingerprint, entries)
            if answers.count(_MISS_ANSWER) == len(answers):  # identity first: C speed
                continue
            tier, left = link.tier.tier, []
            hit = (Status.OK, tier, None)  # shared by the hits without entries
            for i, answer in zip(todo, answers):
                status, entry = answer
                if status is Status.MISS:
                    left.append(i)
                else:
                    out[i] = hit if entry is None and status is Status.OK else (status, tier, entry)
            todo = left
        return out

    def peek_below(self, ikey: Hashable, local: bool = False) -> ChunkEntry | None:
        """The first usable lower tier's entry under ``ikey`` (any state), without touching it;
        ``local``: of the tiers on this node only (not a ``shared`` one)."""
        for link in self.links:
            if self.usable(link) and not (local and link.tier.shared):
                entry = link.tier.peek(ikey)
                if entry is not None:
                    return entry
        return None

    def check(self, ikeys: Sequence[Hashable], fingerprint: str,
              done: Callable[[], None]) -> bool:
        """Start the batched existence checks that ``ikeys`` (missed by ``lookup``) need; ``done()``
        runs on the loop thread once all answered. False: nothing to check, answer now."""
        todo = []
        for link in self.links:
            if self.checks_in_flight + len(todo) >= MAX_CHECKS_IN_FLIGHT:
                break
            if self.usable(link):
                keys = link.tier.unknown(ikeys, fingerprint)
                if keys:
                    todo.append((link, list(keys)))
        if not todo:
            return False
        left = [len(todo)]

        def one_done() -> None:
            left[0] -= 1
            if not left[0]:
                done()

        for link, keys in todo:
            self.checks_in_flight += 1
            job = link.tier.exists_job(keys, fingerprint)
            self._submit(IoJob("exists", link, keys=keys, fingerprint=fingerprint,
                               done=one_done), job, 0)
        return True

    def tier_stats(self) -> list[tuple[str, dict[str, int]]]:
        return [(self.cpu.name, self.cpu.stats())] + [(t.name, t.stats()) for t in self.lower]

    def space_coming(self) -> bool:
        """Whether arena pages may free up without anyone asking: demotions in flight, PENDING
        chunks (their commit makes them evictable; their abort frees them), or chunks held by
        copies in flight (evictable once released)."""
        return (self.cpu.demoting_pages > 0 or self.cpu.pending_pages > 0
                or self.cpu.held_pages > 0)

    # -- writes ------------------------------------------------------------------------------------
    def demote(self, entry: ChunkEntry) -> bool:
        """A CPU victim: start writing it below (True) or let it go now (False: a tier holds it
        already, or none admits it or has room)."""
        reads = self._reads.pop(entry.ikey, 0)
        why = ""  # why the nearest tier below did not take it: counted if none does
        for link in self.links:
            if link.tier.holds(entry.ikey, entry.checksum):
                return False
            if not self.usable(link):
                why = why or "below_unavailable"
                continue
            if reads < link.policy.after_reads:
                why = why or "admission"
                continue
            target = link.tier.reserve(entry.ikey, entry.fingerprint, entry.nbytes,
                                       entry.checksum)
            if target is None:
                self.metrics.io_failures.labels(link.name, "no_space").inc()
                why = why or "no_room_below"
                continue
            self.cpu.mark_demoting(entry)
            self.cpu.acquire(entry)
            link.queued["demote"].append((entry, target))
            return True
        if why:
            self.metrics.evictions_dropped.labels(self.cpu.name, why).inc()
        return False

    def after_commit(self, entry: ChunkEntry) -> None:
        """A PUT committed ``entry`` to the arena: publish it where the policy says at commit."""
        self.events.stored(self.cpu.name, entry)
        for link in self.links:
            if link.policy.when is Publish.ON_COMMIT and not link.policy.after_reads:
                self._publish(link, entry)

    def after_read(self, entry: ChunkEntry) -> None:
        """A GET served ``entry`` from the arena: the admission filter counts it."""
        if (not self._admission or entry.demoting
                or self.cpu.index.get(entry.ikey) is not entry):
            return
        self._reads[entry.ikey] += 1
        reads = self._reads[entry.ikey]
        for link in self.links:
            if link.policy.when is Publish.ON_COMMIT and link.policy.after_reads == reads:
                self._publish(link, entry)

    def _publish(self, link: Link, entry: ChunkEntry) -> None:
        if not self.usable(link) or link.tier.holds(entry.ikey, entry.checksum):
            return
        target = link.tier.reserve(entry.ikey, entry.fingerprint, entry.nbytes, entry.checksum)
        if target is None:
            return
        self.cpu.acquire(entry)
        link.queued["write_through"].append((entry, target))

    # -- reads -------------------------------------------------------------------------------------
    def promote(self, tier: Tier, source: ChunkEntry, target: ChunkEntry,
                done: Callable[[bool, str], None]) -> None:
        """Read ``source`` from ``tier`` into reserved arena pages (``target``, PENDING); commit
        the target and ``done(True, "")``, or abort it and ``done(False, why)``. Queued: the read
        starts at the next ``flush`` (the loop's, after the request), batched with the other
        promotions from that tier."""
        link = self.link(tier)
        link.tier.acquire(source)
        link.reads.append(Promotion(source, target, done))

    # -- removal -----------------------------------------------------------------------------------
    def delete(self, ikey: Any) -> Status:
        entry = self.cpu.index.get(ikey)
        status = self.cpu.delete(ikey)
        if status is Status.OK:
            self._reads.pop(ikey, None)
            self.events.dropped(self.cpu.name, entry)
        for link in self.links:
            below = link.tier.delete(ikey)  # even while unavailable: bookkeeping, I/O deferred
            if status is Status.MISS:
                status = below
        self.flush_deletions()
        return status

    def drop_cpu(self, entry: ChunkEntry) -> None:
        """Remove an arena chunk that failed its check (it stays below, if it is there)."""
        if self.cpu.index.get(entry.ikey) is entry and self.cpu.delete(entry.ikey) is Status.OK:
            self._reads.pop(entry.ikey, None)
            self.events.dropped(self.cpu.name, entry)

    def _cpu_evicted(self, entry: ChunkEntry) -> None:
        self._reads.pop(entry.ikey, None)
        self.events.dropped(self.cpu.name, entry)

    def _lower_dropped(self, link: Link, entry: ChunkEntry) -> None:
        self.events.dropped(link.name, entry)

    def _lower_evicted(self, link: Link, entry: ChunkEntry) -> bool:
        """``link``'s tier evicts ``entry``: maybe held and queued further down
        (``kvtierd.server.chain_cascade``). False: it is to go further down but the bounce pages
        are in use, so it stays for now (and the chunk that needed its room goes below itself)."""
        cascade = chain_cascade.hold(self, link, entry)
        if cascade is chain_cascade.NO_ROOM:
            return False
        if cascade is not None:
            cascade[0].cascades.append(cascade[1])
        return True

    # -- submitting --------------------------------------------------------------------------------
    def flush(self) -> None:
        """Submit the reads, writes and deletes queued during this loop iteration, and the probes
        that are due (called by the loop)."""
        self.probe()
        for link in self.links:
            if link.reads:
                reads, link.reads = link.reads, []
                self._submit_reads(link, reads)
            if link.cascades:
                cascades, link.cascades = link.cascades, []
                for batch in split(cascades, lambda c: c.target.nbytes, WRITE_JOB_BYTES):
                    self._submit(IoJob("cascade", link, cascades=batch),
                                 chain_cascade.job(self.cpu, link, batch),
                                 sum(c.target.nbytes for c in batch))
            for kind, queued in link.queued.items():
                if queued:
                    link.queued[kind] = []
                    self._submit_batches(link, kind, queued)
        self.flush_deletions()

    def _submit_batches(self, link: Link, kind: str,
                        queued: list[tuple[ChunkEntry, ChunkEntry]]) -> None:
        # Spread over the I/O threads, but never below the tier's write_job_bytes per job.
        total = sum(c.nbytes for c, _ in queued)
        per_job = max(link.tier.write_job_bytes, -(-total // link.engine.threads))
        for batch in split(queued, lambda pair: pair[0].nbytes, per_job):
            self._submit_writes(link, kind, batch, sum(c.nbytes for c, _ in batch))

    def _submit_writes(self, link: Link, kind: str, batch: list[tuple[ChunkEntry, ChunkEntry]],
                       size: int) -> None:
        items = [(target, cpu_entry.runs) for cpu_entry, target in batch]
        self._submit(IoJob(kind, link, writes=batch), link.tier.write_job(items, self.cpu.arena),
                     size)

    def _submit_reads(self, link: Link, reads: list[Promotion]) -> None:
        total = sum(r.target.nbytes for r in reads)
        per_job = total if link.tier.batched_reads else min(
            READ_JOB_BYTES, -(-total // link.engine.threads))
        for batch in split(reads, lambda r: r.target.nbytes, per_job):
            items = [(r.source, r.target.runs, self.cpu.segments(r.target)) for r in batch]
            self._submit(IoJob("promote", link, reads=batch),
                         link.tier.read_batch_job(items, self.cpu.arena),
                         sum(r.target.nbytes for r in batch))

    def flush_deletions(self) -> None:
        for link in self.links:
            entries = link.tier.take_deletions()
            if entries:
                self._submit(IoJob("delete", link, deleted=entries),
                             link.tier.delete_job(entries), 0)

    def _submit(self, job: IoJob, fn: Callable[[], Any], nbytes: int) -> None:
        done = job.link.engine.submit(nbytes, fn, job)
        assert done is None, "the I/O engine never runs jobs inline"

    # -- completions (kvtierd.server.chain_io) -----------------------------------------------------
    def on_io_done(self, job: IoJob, result: Any, error: BaseException | None) -> None:
        chain_io.complete(self, job, result, error)
        self.flush()

    def check_invariants(self) -> None:
        for tier in self.lower:
            tier.check_invariants()
        if self.bounce is not None:
            self.bounce.allocator.check_invariants()
            held = sum(n for link in self.links for c in link.cascades for _, n in c.bounce)
            assert held <= self.bounce.pages - self.bounce.allocator.free_pages, "bounce pages lost"

    def close(self, snapshot: bool = False) -> None:
        """Close the tiers' own pools (waiting for their jobs), then the tiers; ``snapshot``
        (a clean stop, every job drained): each tier first writes its index snapshot."""
        for engine in self._own_engines:
            engine.close()
        self._own_engines.clear()
        for tier in self.lower:
            if snapshot:
                tier.save_snapshot()
            tier.close()
