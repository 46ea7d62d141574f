"""The seam of the tier chain: what every tier below the arena (NVMe, remote) provides.

The chain (``kvtierd.server.chain.TierChain``) is ordered cpu → lower tiers (nvme → remote); it
alone decides *when* bytes move (lookups across tiers, promotion into the arena, demotion and
publishing, faults, circuit breaking, metrics, the "stored in / dropped from tier X" events). A
``LowerTier`` only says *how*: bookkeeping on the daemon's loop thread, blocking I/O in *jobs*.

Threads. Every method below runs on the loop thread, never concurrently with another, and must not
block (no network, no disk, no sleeping). The ``*_job`` methods return a zero-argument callable that
the chain runs on the I/O engine (``kvtierd.copy.engine.CopyEngine``, its own thread pool); the job
does the blocking work and returns its result (or raises), and the chain hands that back to the
tier's ``*_done``/``commit``/``abort`` on the loop thread. A job may only touch the arena pages it
was given, its own connection/files, and state it owns that is thread-safe; never the tier's index.

Bytes always move between a lower tier and *arena pages*: ``runs`` (page runs of the arena,
``kvtierd.tiers.allocator.Run``) of a chunk's payload in payload order, and ``segments`` (byte
ranges ``(offset, length)`` of the arena view) for checksums. A remote tier that registers the
arena with its transfer engine can move them zero-copy (``arena.address``, ``arena.nbytes``,
``arena.view``).

Entries. A lower tier describes its chunks with ``kvtierd.tiers.chunk.ChunkEntry`` (``ikey``,
``fingerprint``, ``nbytes``, ``checksum``, ``ref_count``, ``pin_count``, ``doomed``; ``runs`` may be
``[]`` where the tier has no local pages). ``ikey`` is ``((tenant, namespace, rank), key)``: a tier
that stores objects elsewhere must put all of it (and the fingerprint, or check it on read) in the
object's name/header so that two tenants, namespaces, ranks or layouts never share an object.

What an implementation must provide (``NvmeTier`` via ``kvtierd.tiers.nvme_lower`` is one; the
remote tier is another):

``name`` / ``tier``
    Metric label and STATS key (``"nvme"``, ``"remote"``), and the ``protocol.Tier`` LOOKUP answers.
``lookup(ikey, fingerprint) -> (Status, entry | None)``
    What the tier knows *now*, without I/O: ``OK`` and a READY entry, ``MISS``, or
    ``LAYOUT_MISMATCH`` (the key is held for another layout: never bytes for the wrong reader). A
    hit's ``nbytes`` may be ``0`` when only a read can tell the size (the reader's is then used).
``lookup_many(ikeys, fingerprint, entries) -> list[(Status, entry | None)]``
    ``lookup`` of each key (the same touches and counts, in key order), for a LOOKUP's batch.
    ``entries=False`` (nothing is to be leased): a hit may be ``(OK, None)``, so a tier that
    keeps lighter records than entries (the remote tier's existence-check hits) builds none.
    The default asks ``lookup`` key by key.
``checks_existence`` / ``unknown(ikeys, fingerprint) -> list``
    ``checks_existence = True`` says that ``lookup`` alone cannot tell (remote); ``unknown`` then
    returns, of these keys (all missed by every tier), those only an existence check can tell
    about (not recently checked). The defaults (False, ``[]``) suit a tier whose index is complete
    (NVMe). A GET consults ``lookup`` only: a key never checked (no LOOKUP before) is a miss.
``exists_job(ikeys, fingerprint) -> job returning list[bool]``
    One batched existence check for a LOOKUP's unknown keys (Mooncake ``batch_is_exist``);
    ``exists_done(ikeys, fingerprint, found)`` records the answer on the loop thread, after which
    ``lookup`` answers from it (a small bounded cache is the tier's business). ``found is None``:
    the check failed; nothing is recorded.
``peek(ikey) -> entry | None``
    The entry under ``ikey`` in any state (READY or being written), as far as the tier knows
    without I/O, and without touching its eviction order. The chain answers a PUT of a key held
    below ``EXISTS`` (or ``BUSY`` while it is written) without storing it in the arena, and drops a
    CPU victim at once, without writing it, when a tier already holds it with the same checksum
    (``holds``, derived from ``peek``). A tier that wants neither shortcut returns ``None``.
``reserve(ikey, fingerprint, nbytes, checksum) -> entry | None``
    A write target (PENDING, invisible to ``lookup``), or ``None``: already held, too large or no
    room (the chain counts ``no_space`` and leaves the chunk where it is).
``write_job(items, arena) -> job``
    ``items``: ``[(target, source arena runs)]``. Copies the arena pages to the tier and makes them
    durable *before* anything says they exist (crash safety); all or nothing per job. Then
    ``commit(target)`` (READY, visible) or, if the job raised, ``abort(target)``.
``read_job(source, arena, dst_runs, dst_segments) -> job returning bytes``
    Reads ``source`` into the arena pages ``dst_runs`` (reserved by the chain for the chunk's
    ``nbytes``, the reader's when ``source.nbytes`` is 0; ``dst_segments`` sums to it), verifies
    it (checksum; for a remote object also its header: format version, tenant, fingerprint, and a
    length equal to that size) and returns the payload's xxh3-128 checksum as
    ``kvtierd.copy.memcpy.checksum`` computes it over ``dst_segments`` (the arena copy is
    committed with it). A mismatch raises ``IntegrityError``: the chain drops the chunk (``drop``),
    counts ``kvtierd_integrity_failures_total{tier}`` and serves a miss. ``TierUnavailable``: a
    miss, the copy is kept, the circuit opens. Any other error (an object that is gone, EIO): a
    miss, the copy is dropped, ``kvtierd_io_failures_total{tier, reason}``. Bytes never reach a
    client unverified.
``read_batch_job(items, arena) -> job returning list[bytes | Exception]``
    The reads of several promotions in one job (``items``: ``[(source, dst_runs,
    dst_segments)]``, each as for ``read_job``): the chain collects the promotions of a loop
    iteration (one GET, a parked retry) and submits one such job per few MiB, as the CPU path
    does for its copies, because a job's submission, wake-up and completion (and, for a remote
    store, a network round trip) cost as much for one chunk as for many. The result has one
    entry per item, in order: the checksum ``read_job`` would return, or the exception it would
    raise, which the chain handles per item as above (one bad item never fails its
    neighbours). After a ``TierUnavailable`` the remaining items need not be tried (they get
    the same error). The default runs ``read_job`` item by item; a store with batched calls
    (Mooncake ``batch_get_into``) reads them all at once and sets ``batched_reads``.
``acquire(entry)`` / ``release(entry)``
    Around every read job: a referenced entry is not freed (it may be dropped meanwhile: it is then
    ``doomed`` and freed at the last release).
``drop(entry)``
    Remove a READY chunk now (it failed a read). It calls ``on_drop(entry)``, as every removal
    (eviction, DELETE, drop) must: the chain sets ``on_drop`` to learn "dropped from this tier".
``delete(ikey) -> Status``
    ``OK``, ``MISS`` or ``BUSY`` (being written). Removal I/O is deferred: ``take_deletions()``
    returns what is waiting (or ``None``), ``delete_job(entries)`` does it, ``deleted(entries)``
    completes it on the loop thread (pages/keys reusable only then).
``stats() -> dict[str, int]``
    O(1) running totals (STATS, ``kvtierd stats``, the ``kvtierd_tier_*`` gauges); must hold
    ``capacity_bytes``, ``used_bytes``, ``chunks`` and ``pending_chunks`` (0 where unknown), may
    hold ``evictions`` and the tier's own counters.
``available() -> bool``
    False while the tier knows itself unreachable (its own health check). Independently, a job that
    raises ``TierUnavailable`` opens the chain's circuit for the tier for ``retry_s`` seconds.
    While either says no, the chain skips the tier for lookups, reads and writes (local tiers keep
    serving), logs once per opening and sets ``kvtierd_tier_available{tier}``.
``io_threads``
    0 (share the daemon's I/O pool) or the size of the tier's own pool; a job should still bound
    its own time (a timeout that raises ``TierUnavailable``), as it holds a thread meanwhile.
``check_invariants()`` and ``close()``.

Publishing (``PublishPolicy``, configured per lower tier). Every chunk that leaves the arena (a CPU
victim) walks the lower tiers in order: the first that already ``holds`` it ends the walk (the
chunk is dropped from the arena, a copy stays below); otherwise the first usable tier that admits
it and has room (``reserve``) gets it written (demotion: it stays readable in the arena until
durable there). That is ``on-evict``: a tier only receives what leaves the tiers above it.
``on-commit`` adds an asynchronous write of every committed chunk (NVMe's write-through; the
remote tier's default). ``after_reads`` is an admission filter: a chunk is written to the tier only
once it has been read (GET) that many times (vLLM's ``store_threshold``); 0 admits every chunk.
A chunk evicted from a lower tier itself is dropped; it does not cascade further down.

Events: "chunk now durable in tier X" and "chunk dropped from tier X" happen in one place, the
chain's ``ChainEvents`` (``stored``/``dropped``), for every tier including the arena.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Sequence

from kvtierd.protocol import Status, Tier
from kvtierd.tiers.allocator import Run
from kvtierd.tiers.arena import Arena
from kvtierd.tiers.chunk import ChunkEntry, ChunkState

Job = Callable[[], Any]
#: ``lookup_many``'s answer for a miss (one object: a batch of misses is recognised in C).
MISS_ANSWER: tuple[Status, ChunkEntry | None] = (Status.MISS, None)


class IntegrityError(Exception):
    """Bytes read back do not match what was recorded when the chunk was written (checksum, or a
    remote object's header): the chunk is dropped and the reader gets a miss."""


class TierUnavailable(Exception):
    """The tier as a whole cannot be reached now (master down, connection refused, timeout): not a
    fault of one chunk. Raised by a job; the chain stops using the tier for its ``retry_s``."""


def detached(exc: Exception) -> Exception:
    """``exc`` without its tracebacks (and its context's), to be kept as a result: a traceback
    keeps the job's frames alive, with their views of the arena (whose mapping then cannot be
    closed) and, through the result list, a reference cycle only the collector breaks."""
    seen: BaseException | None = exc
    while seen is not None:
        seen.__traceback__ = None
        seen = seen.__cause__ or seen.__context__
    return exc


class Publish(str, enum.Enum):
    ON_COMMIT = "on-commit"
    ON_EVICT = "on-evict"


@dataclass(frozen=True)
class PublishPolicy:
    # When a chunk is written to this tier: at commit (asynchronously) or when it leaves the tiers
    # above it.
    when: Publish = Publish.ON_EVICT
    # Admission filter: publish a chunk only once it was read (GET) this many times; 0 = always.
    after_reads: int = 0


class LowerTier(ABC):
    """A tier below the arena; see the module docstring for the contract."""

    name: str
    tier: Tier
    #: True when ``lookup`` alone cannot tell (remote): ``unknown``/``exists_job`` are then used.
    checks_existence: bool = False
    #: True when the tier is shared with other nodes (remote): what it holds is not stored on this
    #: node, so a PUT of such a chunk (an engine that recomputed a remote hit) is stored in the
    #: local tiers instead of answered EXISTS.
    shared: bool = False
    #: 0: this tier's jobs share the daemon's I/O pool (``io_threads``). N > 0: the chain gives it
    #: its own pool of N threads, so that a slow or hanging tier (network timeouts) never queues
    #: another tier's jobs behind its own. A remote tier should have its own.
    io_threads: int = 0
    #: How the chain cuts one iteration's promotions into read jobs (``read_batch_job``). False:
    #: the jobs read item by item (NVMe), so the chain spreads them over the I/O threads for
    #: parallel I/O. True: a job's reads are batched calls that move their objects concurrently
    #: themselves (Mooncake), so the chain makes one job: measured on Mooncake over TCP
    #: (benchmarks/remote_tier.py, 2 MiB objects), four concurrent jobs fetched 0.46-0.63x of
    #: Mooncake's own sequential batches, one job 0.86-0.88x.
    batched_reads: bool = False
    #: Bytes a read job may write right after a payload, inside the target's own pages (the
    #: remote tier lands an object's trailing header there, to read it as one buffer). The CPU
    #: tier reserves a promotion target with this much room when a contiguous run of free pages
    #: has it (never evicting for it) and frees the spare pages at commit; the job must not
    #: count on it (``header_fits_after``).
    read_slack_bytes: int = 0
    #: Seconds the chain skips this tier after a job raised TierUnavailable.
    retry_s: float = 10.0
    #: What the chain cuts the writes (demotions, on-commit publishing) queued in one loop
    #: iteration into: jobs of about this many bytes, at least (spread over the tier's I/O
    #: threads when there are more). Every job pays one durable commit (fdatasync and index
    #: transaction, or one batched remote put), shared by its chunks; a smaller job frees its
    #: arena pages sooner, so that the next demotion round starts while the others write.
    write_job_bytes: int = 32 * 1024**2
    #: Set by the chain; every removal from the tier's index calls it.
    on_drop: Callable[[ChunkEntry], None]
    #: Set by the chain; a tier that evicts (NVMe) calls it for each victim just before dropping
    #: it, so that the chain may ``acquire`` the victim to copy it further down (its pages are then
    #: freed when it is released, as for any doomed chunk). False: the victim must stay for now (it
    #: is to be copied further down, but the chain has no room to copy it yet); the tier then stops
    #: evicting (warmer victims stay too) and counts ``evictions_deferred``. The default: True.
    on_evict: Callable[[ChunkEntry], bool] = staticmethod(lambda entry: True)

    # -- lookups -------------------------------------------------------------------------------
    @abstractmethod
    def lookup(self, ikey: Hashable, fingerprint: str) -> tuple[Status, ChunkEntry | None]: ...

    def lookup_many(self, ikeys: Sequence[Hashable], fingerprint: str, entries: bool = True
                    ) -> list[tuple[Status, ChunkEntry | None]]:
        lookup = self.lookup
        return [lookup(ikey, fingerprint) for ikey in ikeys]

    def unknown(self, ikeys: Sequence[Hashable], fingerprint: str) -> list[Hashable]:
        return []

    def probe_job(self) -> Job | None:
        """A job that reaches the tier (raising ``TierUnavailable`` while it cannot), run after a
        job tripped its circuit and ``retry_s`` passed, off the request path: the circuit closes
        only once it succeeds. None (the default): the circuit closes at once and the next job
        tells (a local tier, whose jobs fail fast)."""
        return None

    def exists_job(self, ikeys: Sequence[Hashable], fingerprint: str) -> Job:
        raise NotImplementedError(f"the {self.name} tier's index is complete; nothing to check")

    def exists_done(self, ikeys: Sequence[Hashable], fingerprint: str,
                    found: list[bool] | None) -> None:
        return None

    @abstractmethod
    def peek(self, ikey: Hashable) -> ChunkEntry | None: ...

    def holds_any(self, space: tuple, keys: Sequence[bytes]) -> bool:
        """Whether ``peek`` finds any of ``keys`` of ``space`` here (a PUT batch's fast path is
        for keys that no lower tier holds; a tier with a dict of them checks it in C)."""
        return any(self.peek((space, key)) is not None for key in keys)

    def holds(self, ikey: Hashable, checksum: bytes) -> bool:
        """Whether a READY copy with this checksum is here (a CPU victim then leaves for free)."""
        entry = self.peek(ikey)
        return entry is not None and entry.state is ChunkState.READY and entry.checksum == checksum

    # -- writes --------------------------------------------------------------------------------
    @abstractmethod
    def reserve(self, ikey: Hashable, fingerprint: str, nbytes: int, checksum: bytes
                ) -> ChunkEntry | None: ...

    @abstractmethod
    def write_job(self, items: list[tuple[ChunkEntry, list[Run]]], arena: Arena) -> Job: ...

    @abstractmethod
    def commit(self, entry: ChunkEntry) -> None: ...

    @abstractmethod
    def abort(self, entry: ChunkEntry) -> None: ...

    # -- reads ---------------------------------------------------------------------------------
    @abstractmethod
    def read_job(self, entry: ChunkEntry, arena: Arena, dst_runs: list[Run],
                 dst_segments: list[tuple[int, int]]) -> Job: ...

    def read_batch_job(self, items: list[tuple[ChunkEntry, list[Run], list[tuple[int, int]]]],
                       arena: Arena) -> Job:
        """Item by item through ``read_job`` (see the module docstring)."""
        jobs = [self.read_job(entry, arena, runs, segs) for entry, runs, segs in items]

        def job() -> list[bytes | Exception]:
            out: list[bytes | Exception] = []
            for read in jobs:
                try:
                    out.append(read())
                except TierUnavailable as exc:  # the rest would only wait for the same timeout
                    out.extend([detached(exc)] * (len(jobs) - len(out)))
                    break
                except Exception as exc:  # this item's fault; the chain sorts it out
                    out.append(detached(exc))
            return out

        return job

    @abstractmethod
    def acquire(self, entry: ChunkEntry) -> None: ...

    @abstractmethod
    def release(self, entry: ChunkEntry) -> None: ...

    # -- removal -------------------------------------------------------------------------------
    @abstractmethod
    def drop(self, entry: ChunkEntry) -> None: ...

    @abstractmethod
    def delete(self, ikey: Hashable) -> Status: ...

    @abstractmethod
    def take_deletions(self) -> list[ChunkEntry] | None: ...

    @abstractmethod
    def delete_job(self, entries: list[ChunkEntry]) -> Job: ...

    @abstractmethod
    def deleted(self, entries: list[ChunkEntry]) -> None: ...

    # -- health and introspection --------------------------------------------------------------
    def available(self) -> bool:
        return True

    @abstractmethod
    def stats(self) -> dict[str, int]: ...

    @abstractmethod
    def check_invariants(self) -> None: ...

    def save_snapshot(self) -> bool:
        """At a clean stop, before ``close``: save what makes the next start fast (the NVMe
        tier's index snapshot); False when there is nothing to save."""
        return False

    @abstractmethod
    def close(self) -> None: ...
