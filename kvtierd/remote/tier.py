"""The remote tier: a link of the tier chain (``kvtierd.tiers.lower.LowerTier``) on a shared store.

The store (``kvtierd.remote.mooncake.MooncakeStore``) is shared by every node, so this tier's index
can never be complete: it remembers (``known``, bounded LRU) the objects it wrote and the ones an
existence check found, and asks the store about every other key of a LOOKUP (``unknown`` →
``exists_job``). A known object's size may be unknown (found by an existence check): the reader's
size is used, and an object of another size is a miss, never bytes.

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
``batch_get_into_multi_buffers`` per ``max_batch`` objects and verified object by object (on a
verifier thread, while the next batch is on the wire), so a missing or corrupt object is a miss
for its item only. One call per chunk cost a round trip each
(fetch was 0.26-0.50x of Mooncake's own batched client).

Connection: the first job connects (blocking, on an I/O thread, never at start on the loop): a
daemon whose master is down starts and serves its local tiers; each failed attempt raises
``TierUnavailable`` so the chain retries after ``retry_s``. Mooncake itself reconnects to a
restarted master.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Hashable, Sequence

from kvtierd.config_remote import RemoteConfig
from kvtierd.copy.memcpy import checksum as payload_checksum
from kvtierd.protocol import Status, Tier
from kvtierd.remote import objects
from kvtierd.remote.mooncake import MooncakeStore, RemoteSetupError
from kvtierd.tiers.allocator import Run
from kvtierd.tiers.arena import Arena
from kvtierd.tiers.chunk import ChunkEntry, ChunkState, segments
from kvtierd.tiers.lower import IntegrityError, Job, LowerTier, TierUnavailable, detached


#: How long an existence check's "absent" answer is trusted (another node may publish it since).
ABSENT_TTL_S = 1.0


class RemoteMiss(Exception):
    """The object is not (or no longer) in the store, or has another size: a plain miss."""


class RemoteWriteFailed(Exception):
    """Some objects of a write job were refused by the store (no space, ...): the job fails."""


@dataclass(frozen=True)
class _Read:
    """One object of a read job: its name, the chunk, and where its payload lands."""

    name: str
    entry: ChunkEntry
    segments: list[tuple[int, int]]  # arena view byte ranges, payload order
    buffers: list[tuple[int, int]]  # the same as registered addresses
    inline: bool  # the target's pages have room for the header right after the payload


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
            return run_end - end >= objects.HEADER_BYTES
    return False


class RemoteTier(LowerTier):
    name = "remote"
    tier = Tier.REMOTE
    checks_existence = True  # other nodes publish too: only the store knows
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
        self.known: OrderedDict[Hashable, ChunkEntry] = OrderedDict()
        self.pending: dict[Hashable, ChunkEntry] = {}
        # Keys an existence check found absent, with when to ask again (insertion = expiry order).
        self._absent: OrderedDict[Hashable, float] = OrderedDict()
        self.clock = time.monotonic
        self._deletions: list[ChunkEntry] = []
        self._used_bytes = 0
        # Names a read found missing (or of another size): dropped without removing the object,
        # which may be another reader's valid chunk. Written by jobs, read on the loop thread.
        self._missing: set[str] = set()
        self._missing_lock = threading.Lock()
        self._connect_lock = threading.Lock()
        self._connected = False
        self._verify_pool: ThreadPoolExecutor | None = None  # started by the first read

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
        entry = self.known.get(ikey)
        if entry is None or entry.fingerprint != fingerprint or entry.doomed:
            return Status.MISS, None  # another layout's object has another name: a plain miss
        self.known.move_to_end(ikey)
        return Status.OK, entry

    def peek(self, ikey: Hashable) -> ChunkEntry | None:
        return self.pending.get(ikey) or self.known.get(ikey)

    def unknown(self, ikeys: Sequence[Hashable]) -> list[Hashable]:
        """Keys not being written here and not found absent in the last ``ABSENT_TTL_S``: an
        engine asking about the same missing prefix every step asks the master once a second."""
        now = self.clock()
        absent = self._absent
        while absent and next(iter(absent.values())) <= now:
            absent.popitem(last=False)
        return [k for k in ikeys if k not in self.pending and k not in absent]

    def exists_job(self, ikeys: Sequence[Hashable], fingerprint: str) -> Job:
        names = objects.object_names(self.cfg.cluster_id, ikeys, fingerprint)
        return lambda: self._ready().exists(names)

    def exists_done(self, ikeys: Sequence[Hashable], fingerprint: str,
                    found: list[bool] | None) -> None:
        if found is None:
            return
        expiry = self.clock() + ABSENT_TTL_S
        for ikey, hit in zip(ikeys, found):
            if not hit:
                self._absent.pop(ikey, None)  # re-inserted last: expiries stay in order
                self._absent[ikey] = expiry
                while len(self._absent) > self.cfg.known_keys:
                    self._absent.popitem(last=False)
                continue
            self._absent.pop(ikey, None)
            current = self.known.get(ikey)
            if hit and (current is None or current.fingerprint != fingerprint):
                if current is not None:
                    self._forget(current)
                entry = ChunkEntry(ikey, fingerprint, 0, [], 0, state=ChunkState.READY)
                self._remember(entry)

    # -- writes ------------------------------------------------------------------------------------
    def reserve(self, ikey: Hashable, fingerprint: str, nbytes: int, checksum: bytes
                ) -> ChunkEntry | None:
        held = self.known.get(ikey)
        if ikey in self.pending or (held is not None and held.fingerprint == fingerprint):
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
            stored = self._ready().put(names, headers, payloads)
            refused = stored.count(False)
            if refused:
                raise RemoteWriteFailed(f"the store refused {refused} of {len(names)} objects")
            return sum(t.nbytes for t, _ in items)

        return job

    def commit(self, entry: ChunkEntry) -> None:
        self.pending.pop(entry.ikey, None)
        self._absent.pop(entry.ikey, None)
        entry.state = ChunkState.READY
        current = self.known.get(entry.ikey)
        if current is not None:
            self._forget(current)
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
        reads = [_Read(self.name_of(entry.ikey, entry.fingerprint), entry, segs,
                       [(arena.address + offset, length) for offset, length in segs],
                       header_fits_after(runs, segs, page))
                 for entry, runs, segs in items]
        step = self.cfg.max_batch

        def job() -> list[bytes | Exception]:
            store = self._ready()
            out: list[bytes | Exception] = []
            checking: Future | None = None  # the previous batch's verification
            for start in range(0, len(reads), step):
                part = reads[start : start + step]
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
                checking = self._verifier().submit(self._verify_part, arena, part, raws)
            if checking is not None:
                out.extend(checking.result())
            return out

        return job

    def _verifier(self) -> ThreadPoolExecutor:
        if self._verify_pool is None:
            with self._connect_lock:
                if self._verify_pool is None:
                    self._verify_pool = ThreadPoolExecutor(
                        1, thread_name_prefix="kvtierd-remote-verify")
        return self._verify_pool

    def _verify_part(self, arena: Arena, part: list[_Read], raws: list[bytes | None]
                     ) -> list[bytes | Exception]:
        return [self._verified(arena, read, raw) for read, raw in zip(part, raws)]

    def _verified(self, arena: Arena, read: _Read, raw: bytes | None) -> bytes | Exception:
        """The payload's checksum if ``raw`` (the header read) and the payload are this chunk's;
        else the item's error (on an I/O thread: only ``_missing`` is shared, under its lock)."""
        nbytes = sum(length for _, length in read.segments)
        if raw is None:
            with self._missing_lock:
                self._missing.add(read.name)
            return RemoteMiss(f"{read.name}: not in the store (or not {nbytes} bytes)")
        try:
            header = objects.check_header(raw, read.name, read.entry.ikey,
                                          read.entry.fingerprint, nbytes)
        except objects.HeaderMismatch as exc:
            return IntegrityError(f"remote object {read.name}: {exc}")
        got = payload_checksum(arena.view, read.segments)
        if got != header.checksum:
            return IntegrityError(f"remote object {read.name}: payload checksum {got.hex()} "
                                  f"differs from its header's {header.checksum.hex()}")
        return got

    def acquire(self, entry: ChunkEntry) -> None:
        entry.ref_count += 1

    def release(self, entry: ChunkEntry) -> None:
        entry.ref_count -= 1

    # -- removal -----------------------------------------------------------------------------------
    def drop(self, entry: ChunkEntry) -> None:
        """Forget the object and remove it from the store (it failed a read), unless the read
        found it missing or of another size: then it is only forgotten."""
        if self.known.get(entry.ikey) is entry:
            self._forget(entry)
        entry.doomed = True
        name = self.name_of(entry.ikey, entry.fingerprint)
        with self._missing_lock:
            missing = name in self._missing
            self._missing.discard(name)
        if not missing:
            self._deletions.append(entry)
        self.on_drop(entry)

    def delete(self, ikey: Hashable) -> Status:
        if ikey in self.pending:
            return Status.BUSY
        entry = self.known.get(ikey)
        if entry is None:
            return Status.MISS
        self._forget(entry)
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
        while len(self.known) > self.cfg.known_keys:  # forgetting is safe: a LOOKUP asks again
            _, oldest = self.known.popitem(last=False)
            self._used_bytes -= oldest.nbytes

    def _forget(self, entry: ChunkEntry) -> None:
        del self.known[entry.ikey]
        self._used_bytes -= entry.nbytes

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
        assert all(e.state is ChunkState.READY and not e.doomed for e in self.known.values())
        assert all(e.state is ChunkState.PENDING for e in self.pending.values())
        assert self._used_bytes == sum(e.nbytes for e in self.known.values()), "used_bytes drift"
        assert len(self.known) <= self.cfg.known_keys
        assert all(e.ref_count >= 0 for e in self.known.values())

    def close(self) -> None:
        if self._verify_pool is not None:
            self._verify_pool.shutdown(wait=True)
            self._verify_pool = None
        self.store.close()
        self._connected = False

