"""The remote tier: a link of the tier chain (``kvtierd.tiers.lower.LowerTier``) on a shared store.

The store (``kvtierd.remote.mooncake.MooncakeStore``) is shared by every node, so this tier's index
can never be complete: it remembers (``known``, bounded LRU) the objects it wrote and the ones an
existence check found, and asks the store about every other key of a LOOKUP (``unknown`` →
``exists_job``). A known object's size may be unknown (found by an existence check): the reader's
size is used, and an object of another size is a miss, never bytes.

An object only an existence check found is remembered as its fingerprint (a ``str`` in ``known``):
an entry per hit of a 1024-key check cost more than Mooncake's ``batch_is_exist`` itself. The entry
(nbytes 0, READY) is built in the record's place when needed (a leasing LOOKUP, a GET's promotion,
``peek``, DELETE); a LOOKUP that leases nothing answers without it (``lookup_many``).

Every object is named and headed by ``kvtierd.remote.objects``; every read checks the header
(format version, tenant, fingerprint, name, length) and the payload's xxh3-128 before the chain
may commit the arena copy: a mismatch raises ``IntegrityError`` (the chain drops the entry, which
queues the object's removal from the store, and counts
``kvtierd_integrity_failures_total{tier="remote"}``).

Objects carry their header after the payload (``kvtierd.remote.objects``), and the CPU tier
reserves a promotion's pages with ``read_slack_bytes`` to spare where a contiguous run is free, so
most reads land header and payload as one buffer.

Reads are batched (``read_batch_job``, ``batched_reads``): the chain hands the tier all the
promotions of one loop iteration (one GET, a parked retry) as one job, read with one
``batch_get_into_multi_buffers`` per ``max_batch`` objects or ``READ_CALL_BYTES``
(``kvtierd.remote.reads``) and verified object by object (on a verifier thread, while the next
call is on the wire), so a missing or corrupt object is a miss
for its item only. One call per chunk cost a round trip each (fetch was 0.26-0.50x of Mooncake's).

Connection: the first job connects (blocking, on an I/O thread, never at start on the loop): a
daemon whose master is down starts and serves its local tiers; each failed attempt raises
``TierUnavailable`` so the chain retries after ``retry_s``. Mooncake itself reconnects to a
restarted master.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from itertools import compress, repeat
from operator import not_
from typing import Hashable, Sequence, Union

from kvtierd.config_remote import RemoteConfig
from kvtierd.protocol import Status, Tier
from kvtierd.remote import objects
from kvtierd.remote.absent import AbsentCache
from kvtierd.remote.mooncake import OBJECT_ALREADY_EXISTS, MooncakeStore, RemoteSetupError
from kvtierd.remote.reads import READ_CALL_BYTES, Read, header_fits_after, read_calls
from kvtierd.remote.verify import RemoteMiss, Verifier
from kvtierd.tiers.allocator import Run
from kvtierd.tiers.arena import Arena
from kvtierd.tiers.chunk import ChunkEntry, ChunkState, segments
from kvtierd.tiers.lower import MISS_ANSWER, IntegrityError, Job, LowerTier, TierUnavailable
from kvtierd.tiers.lower import detached

log = logging.getLogger(__name__)

#: How long an existence check's "absent" answer is trusted (another node may publish it since).
ABSENT_TTL_S = 1.0
#: Layouts whose "absent" answers are kept at once (each its own ``AbsentCache``): an object is
#: named by its layout's fingerprint too, so one layout's absent answer says nothing about
#: another's. A node serves a few layouts; past this many the least recently asked is forgotten
#: (its keys are only checked again).
ABSENT_LAYOUTS = 16

#: What ``RemoteTier.known`` holds per key: the entry, or (found only by an existence check, no
#: entry built yet) the object's layout fingerprint.
Known = Union[ChunkEntry, str]
_HIT_ANSWER: tuple[Status, ChunkEntry | None] = (Status.OK, None)  # lookup_many, entries=False


def _fingerprint(record: Known) -> str:
    return record if record.__class__ is str else record.fingerprint  # type: ignore


class RemoteWriteFailed(Exception):
    """Some objects of a write job were refused by the store (no space, ...): the job fails."""


class RemoteTier(LowerTier):
    name = "remote"
    tier = Tier.REMOTE
    checks_existence = True  # other nodes publish too: only the store knows
    shared = True  # a chunk held here is not on this node: a PUT of it is stored locally
    batched_reads = True  # one batch_get_into per job (see LowerTier.batched_reads)
    read_slack_bytes = objects.HEADER_BYTES  # the trailing header lands in the target's pages

    def __init__(self, cfg: RemoteConfig, arena: Arena, page_bytes: int,
                 store: MooncakeStore | None = None) -> None:
        self.cfg = cfg
        self.arena = arena
        self.page_bytes = page_bytes
        self.store = store if store is not None else MooncakeStore(cfg)
        self.retry_s = cfg.retry_s
        self.io_threads = cfg.io_threads  # its own pool: see LowerTier.io_threads
        self.on_drop = lambda entry: None
        self.known: OrderedDict[Hashable, Known] = OrderedDict()
        self.pending: dict[Hashable, ChunkEntry] = {}
        # Keys an existence check found absent, with when to ask again, per layout fingerprint.
        self._absent: OrderedDict[str, AbsentCache] = OrderedDict()
        self.clock = time.monotonic
        self._deletions: list[ChunkEntry] = []
        self._used_bytes = 0
        # Names a read found missing (or of another size): dropped without removing the object,
        # which may be another reader's valid chunk. Written by jobs, read on the loop thread.
        self._connect_lock = threading.Lock()
        self._connected = False
        self.verifier = Verifier(self.store, self.io_threads)  # what read jobs fetched

    # -- connection (jobs only) ------------------------------------------------------------------
    def _ready(self) -> MooncakeStore:
        """The connected store; connects on first use. ``TierUnavailable`` while it cannot."""
        if self._connected:
            return self.store
        with self._connect_lock:
            if not self._connected:
                try:
                    self.store.connect()
                    self.store.register(self.arena.address, self.arena.nbytes)
                except RemoteSetupError as exc:
                    raise TierUnavailable(str(exc)) from None
                self._connected = True
        return self.store

    def name_of(self, ikey: Hashable, fingerprint: str) -> str:
        return objects.object_name(self.cfg.cluster_id, ikey, fingerprint)

    # -- lookups -----------------------------------------------------------------------------------
    def lookup(self, ikey: Hashable, fingerprint: str) -> tuple[Status, ChunkEntry | None]:
        record = self.known.get(ikey)
        if record is None:
            return Status.MISS, None
        if record.__class__ is str:
            if record != fingerprint:
                return Status.MISS, None  # another layout's object has another name: a miss
            entry = self._entry(ikey, record)
        else:
            entry = record  # type: ignore[assignment]
            if entry.fingerprint != fingerprint or entry.doomed:
                return Status.MISS, None
        self.known.move_to_end(ikey)
        return Status.OK, entry

    def lookup_many(self, ikeys: Sequence[Hashable], fingerprint: str, entries: bool = True
                    ) -> list[tuple[Status, ChunkEntry | None]]:
        """``lookup`` of each key; ``entries=False`` builds no entry for an object known only
        from an existence check (its hit is ``(OK, None)``). A batch none of whose keys is known
        (a LOOKUP's first pass, before its check) is one C loop."""
        known = self.known
        records = list(map(known.get, ikeys))
        misses = records.count(None)
        if misses == len(records):
            return [MISS_ANSWER] * len(records)
        if not entries and misses + records.count(fingerprint) == len(records):
            # only misses and records of this layout (a LOOKUP's second pass): C loops
            found = [r is not None for r in records]
            for _ in map(known.move_to_end, compress(ikeys, found)):
                pass
            return [_HIT_ANSWER if hit else MISS_ANSWER for hit in found]
        if entries:
            return [MISS_ANSWER if r is None else self.lookup(k, fingerprint)
                    for k, r in zip(ikeys, records)]
        out: list[tuple[Status, ChunkEntry | None]] = []
        for ikey, record in zip(ikeys, records):
            if record is None or _fingerprint(record) != fingerprint or (
                    record.__class__ is not str and record.doomed):  # type: ignore[union-attr]
                out.append(MISS_ANSWER)
            else:
                known.move_to_end(ikey)
                out.append(_HIT_ANSWER)
        return out

    def peek(self, ikey: Hashable) -> ChunkEntry | None:
        pending = self.pending.get(ikey)
        if pending is not None:
            return pending
        record = self.known.get(ikey)
        if record.__class__ is str:
            return self._entry(ikey, record)  # type: ignore[arg-type]
        return record  # type: ignore[return-value]

    def holds(self, ikey: Hashable, checksum: bytes) -> bool:
        """``LowerTier.holds`` without building an entry for a record (asked for every CPU
        victim): a record's checksum is unknown (its entry's would be ``b""``)."""
        if ikey in self.pending:
            return False  # PENDING: not a copy yet
        record = self.known.get(ikey)
        if record is None:
            return False
        if record.__class__ is str:
            return checksum == b""
        return record.state is ChunkState.READY and record.checksum == checksum  # type: ignore

    def _entry(self, ikey: Hashable, fingerprint: str) -> ChunkEntry:
        """The entry of an object known only from an existence check, built in its record's
        place (its LRU position kept): READY, size unknown (0, the reader's size is used)."""
        entry = ChunkEntry(ikey, fingerprint, 0, [], 0, state=ChunkState.READY)
        self.known[ikey] = entry
        return entry

    def _absent_of(self, fingerprint: str, create: bool = False) -> AbsentCache | None:
        """The "found absent" cache of the objects of ``fingerprint`` (made if ``create``)."""
        caches = self._absent
        cache = caches.get(fingerprint)
        if cache is not None:
            caches.move_to_end(fingerprint)
        elif create:
            cache = caches[fingerprint] = AbsentCache(self.cfg.known_keys)
            if len(caches) > ABSENT_LAYOUTS:
                caches.popitem(last=False)
        return cache

    def unknown(self, ikeys: Sequence[Hashable], fingerprint: str) -> list[Hashable]:
        """Keys not being written here and whose object of ``fingerprint`` was not found absent
        in the last ``ABSENT_TTL_S``: an engine asking about the same missing prefix every step
        asks the master once a second, and a reader of another layout is never told "absent"
        by this layout's answer."""
        cache = self._absent_of(fingerprint)
        if cache is None:
            return [k for k in ikeys if k not in self.pending] if self.pending else list(ikeys)
        cache.prune(self.clock())
        absent, pending = cache.check_of, self.pending  # plain dicts: ``in`` stays in C
        if not pending:
            return [k for k in ikeys if k not in absent]
        return [k for k in ikeys if k not in pending and k not in absent]

    def probe_job(self) -> Job:
        """One existence check of a name no object has: it needs the connection (and reconnects
        it) and the master's answer, which is what every later job needs (``LowerTier``)."""
        name = objects.probe_name(self.cfg.cluster_id)
        return lambda: self._ready().exists([name])

    def exists_job(self, ikeys: Sequence[Hashable], fingerprint: str) -> Job:
        names = objects.object_names(self.cfg.cluster_id, ikeys, fingerprint)
        return lambda: self._ready().exists(names)

    def exists_done(self, ikeys: Sequence[Hashable], fingerprint: str,
                    found: list[bool] | None) -> None:
        """Record a check's answer: the absent keys in ``_absent`` until this check's expiry;
        each hit leaves ``_absent`` and, unless held for this layout already (left where it is),
        enters ``known`` last as its fingerprint (within ``known_keys``, oldest out first). Whole-
        batch C calls, not a loop over the keys: the loop cost more than ``batch_is_exist``."""
        if found is None:
            return
        known = self.known
        absent = self._absent_of(fingerprint, create=False in found)
        if False in found:
            now = self.clock()
            expiry = now + ABSENT_TTL_S
            hits = list(compress(ikeys, found))
            if hits and absent.holds_any(hits):  # rare: another check found one absent
                for ikey, hit in zip(ikeys, found):  # in order: the bound is met as it was
                    if hit:
                        absent.discard((ikey,))
                    else:
                        absent.add((ikey,), expiry, now)
            else:
                absent.add(list(compress(ikeys, map(not_, found))), expiry, now)
            if not hits:
                return
        else:
            hits = list(ikeys)
            if absent is not None:
                absent.discard(hits)
        before = len(known)
        for _ in map(known.setdefault, hits, repeat(fingerprint)):  # new ones last; a C loop
            pass
        added = len(known) - before
        if added == len(hits):  # all new here (the common case)
            self._bound_known()
        else:  # some held (or repeated): undo the additions (the last ones), then key by key
            for _ in range(added):
                known.popitem(last=True)
            for ikey in hits:  # in order: a record of another layout is replaced, last
                current = known.get(ikey)
                if current is None:
                    known[ikey] = fingerprint
                elif _fingerprint(current) != fingerprint:
                    self._forget(ikey)
                    known[ikey] = fingerprint
                else:
                    continue
                self._bound_known()  # at once: a held key may be among the oldest

    # -- writes ------------------------------------------------------------------------------------
    def reserve(self, ikey: Hashable, fingerprint: str, nbytes: int, checksum: bytes
                ) -> ChunkEntry | None:
        held = self.known.get(ikey)
        if ikey in self.pending or (held is not None and _fingerprint(held) == fingerprint):
            return None
        entry = ChunkEntry(ikey, fingerprint, nbytes, [], 0, checksum=checksum)
        self.pending[ikey] = entry
        return entry

    def write_job(self, items: list[tuple[ChunkEntry, list[Run]]], arena: Arena) -> Job:
        names, headers, payloads = [], [], []
        for target, runs in items:
            name = self.name_of(target.ikey, target.fingerprint)
            names.append(name)
            headers.append(objects.header_for(name, target.ikey, target.fingerprint,
                                              target.nbytes, target.checksum).pack())
            payloads.append(self._buffers(arena, runs, target.nbytes))

        def job() -> int:
            store = self._ready()
            todo = self._to_write(store, names, [t for t, _ in items])
            codes = store.put([names[i] for i in todo], [headers[i] for i in todo],
                              [payloads[i] for i in todo]) if todo else []
            # ALREADY_EXISTS: another writer's put landed between the check and ours
            refused = sum(1 for code in codes if code not in (0, OBJECT_ALREADY_EXISTS))
            if refused:
                raise RemoteWriteFailed(f"the store refused {refused} of {len(names)} objects")
            return sum(t.nbytes for t, _ in items)

        return job

    def _to_write(self, store: MooncakeStore, names: list[str], targets: list[ChunkEntry]
                  ) -> list[int]:
        """Which objects of a write job to put: the absent ones, and those whose name holds
        something that is not a whole chunk of its key and layout (damaged, cut short, another
        tenant's header: removed first). Mooncake answers a put under an existing name with 0
        and keeps the old object, so a re-publish used to announce a broken object; a whole valid
        copy (another node's) is kept and serves as ours. One existence check per job; an
        object found is read whole once."""
        present = store.exists(names)
        if True not in present:
            return list(range(len(names)))
        todo = []
        for i, here in enumerate(present):
            if here:
                target = targets[i]
                if objects.whole_chunk_length(store.whole(names[i]), names[i], target.ikey,
                                     target.fingerprint) == target.nbytes:
                    continue
                log.warning("remote object %s is not a whole chunk of its key and layout; "
                            "replacing it", names[i])
                store.remove([names[i]])
            todo.append(i)
        return todo

    def commit(self, entry: ChunkEntry) -> None:
        self.pending.pop(entry.ikey, None)
        absent = self._absent_of(entry.fingerprint)
        if absent is not None:
            absent.discard((entry.ikey,))
        entry.state = ChunkState.READY
        if entry.ikey in self.known:
            self._forget(entry.ikey)
        self._remember(entry)

    def abort(self, entry: ChunkEntry) -> None:
        self.pending.pop(entry.ikey, None)

    # -- reads -------------------------------------------------------------------------------------
    def read_job(self, entry: ChunkEntry, arena: Arena, dst_runs: list[Run],
                 dst_segments: list[tuple[int, int]]) -> Job:
        batch = self.read_batch_job([(entry, dst_runs, dst_segments)], arena)

        def job() -> bytes:
            result = batch()[0]
            if isinstance(result, Exception):
                raise result
            return result

        return job

    def read_batch_job(self, items: list[tuple[ChunkEntry, list[Run], list[tuple[int, int]]]],
                       arena: Arena) -> Job:
        """All the items' objects with one ``batch_get_into`` per ``max_batch`` (Mooncake moves
        them concurrently; one call per chunk paid a round trip each), each verified on its
        own: a missing or corrupt object is that item's miss, never its neighbours'."""
        page = self.page_bytes
        reads = [Read(self.name_of(entry.ikey, entry.fingerprint), entry, segs,
                      [(arena.address + offset, length) for offset, length in segs],
                      header_fits_after(runs, segs, page))
                 for entry, runs, segs in items]
        calls = read_calls(reads, self.cfg.max_batch, READ_CALL_BYTES)

        def job() -> list[bytes | Exception]:
            store = self._ready()
            out: list[bytes | Exception] = []
            checking: Future | None = None  # the previous call's verification
            for start, part in calls:
                try:
                    raws = store.get([r.name for r in part], [r.buffers for r in part],
                                     [r.inline for r in part])
                except TierUnavailable as exc:  # the rest would only wait for the same timeout
                    if checking is not None:
                        out.extend(checking.result())
                        checking = None
                    out.extend([detached(exc)] * (len(reads) - start))
                    break
                if checking is not None:
                    out.extend(checking.result())
                # verified while the next batch is on the wire (xxh3 releases the GIL)
                checking = self.verifier.submit(arena, part, raws)
            if checking is not None:
                out.extend(checking.result())
            return out

        return job

    def acquire(self, entry: ChunkEntry) -> None:
        entry.ref_count += 1

    def release(self, entry: ChunkEntry) -> None:
        entry.ref_count -= 1

    # -- removal -----------------------------------------------------------------------------------
    def drop(self, entry: ChunkEntry) -> None:
        """Forget the object and remove it from the store (it failed a read), unless the read
        found it missing or of another size: then it is only forgotten."""
        if self.known.get(entry.ikey) is entry:
            self._forget(entry.ikey)
        entry.doomed = True
        if not self.verifier.take_missing(self.name_of(entry.ikey, entry.fingerprint)):
            self._deletions.append(entry)
        self.on_drop(entry)

    def delete(self, ikey: Hashable) -> Status:
        if ikey in self.pending:
            return Status.BUSY
        record = self.known.get(ikey)
        if record is None:
            return Status.MISS
        entry = self._entry(ikey, record) if record.__class__ is str else record
        self._forget(ikey)
        entry.doomed = True
        self._deletions.append(entry)
        self.on_drop(entry)
        return Status.OK

    def take_deletions(self) -> list[ChunkEntry] | None:
        taken, self._deletions = self._deletions, []
        return taken or None

    def delete_job(self, entries: list[ChunkEntry]) -> Job:
        names = [self.name_of(e.ikey, e.fingerprint) for e in entries]
        return lambda: self._ready().remove(names)

    def deleted(self, entries: list[ChunkEntry]) -> None:
        return None  # nothing local to free: the names were forgotten when dropped

    # -- bookkeeping -------------------------------------------------------------------------------
    def _remember(self, entry: ChunkEntry) -> None:
        self.known[entry.ikey] = entry
        self._used_bytes += entry.nbytes
        self._bound_known()

    def _bound_known(self) -> None:
        """Forget the oldest records beyond ``known_keys`` (safe: a LOOKUP asks again)."""
        known = self.known
        for _ in range(len(known) - self.cfg.known_keys):
            _, oldest = known.popitem(last=False)
            if oldest.__class__ is not str:
                self._used_bytes -= oldest.nbytes  # type: ignore[union-attr]

    def _forget(self, ikey: Hashable) -> None:
        record = self.known.pop(ikey)
        if record.__class__ is not str:
            self._used_bytes -= record.nbytes  # type: ignore[union-attr]

    def _buffers(self, arena: Arena, runs: list[Run], nbytes: int) -> list[tuple[int, int]]:
        """The payload's bytes as registered-memory buffers ``(address, length)``."""
        return [(arena.address + offset, length)
                for offset, length in segments(runs, nbytes, self.page_bytes)]

    def available(self) -> bool:
        return True  # the chain's breaker handles outages; a first connection happens in a job

    def stats(self) -> dict[str, int]:
        return {"capacity_bytes": self.cfg.global_segment_bytes, "used_bytes": self._used_bytes,
                "chunks": len(self.known), "pending_chunks": len(self.pending)}

    def check_invariants(self) -> None:
        entries = {k: r for k, r in self.known.items() if isinstance(r, ChunkEntry)}
        assert all(type(r) is str for k, r in self.known.items() if k not in entries)
        assert all(e.state is ChunkState.READY and not e.doomed for e in entries.values())
        assert all(k == e.ikey for k, e in entries.items())
        assert all(e.state is ChunkState.PENDING for e in self.pending.values())
        assert self._used_bytes == sum(e.nbytes for e in entries.values()), "used_bytes drift"
        assert len(self.known) <= self.cfg.known_keys
        assert len(self._absent) <= ABSENT_LAYOUTS
        for cache in self._absent.values():
            cache.check_invariants()
        assert all(e.ref_count >= 0 for e in entries.values())

    def close(self) -> None:
        self.verifier.close()
        self.store.close()
        self._connected = False

