"""PUT and GET items of the common case, a job's worth per tier call: a session with shared
staging (memfd or CUDA IPC).

Why: at 16 KiB a chunk's memcpy takes ~2 µs, so the loop thread's Python per item decides the
throughput. Here the handler has already checked every item (``kvtierd.server.data_ops``); these
reserve or look up a job's worth of items in one call of the CPU tier's batch primitives
(``kvtierd.tiers.cpu_batch``, the same semantics as the per-item ones) and queue them as one job,
so the copy threads start on the first job while the loop prepares the next. Where nothing
wants a PUT's chunks as entries (no kv-events, no tier written at commit), a group of new keys
is reserved by slot and copied and committed as columns (``SlotWrites``), as GET holds its
reads: at 16 KiB building, committing and folding an entry per chunk was a third of a PUT item's
loop CPU. With tiers below, a PUT batch comes here when none of them holds any of its keys, and
a GET's arena misses go on to them item by item (``missed``). Anything else (inline payloads,
keys held below, an admission filter counting reads) takes the per-item path in ``data_ops``.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

from kvtierd.protocol import Status
from kvtierd.server.batch import (GROW_MIN_ITEMS, LARGE_JOB_BYTES, Batch, JobQueue, SlotReads,
                                  SlotWrites, job_bounds)
from kvtierd.server.sessions import SessionTable
from kvtierd.tiers.cpu import CpuTier


class Checked:
    """A batch's checked items as columns, in item order: their indices in the request, keys,
    staging offsets and sizes (``requests.common_columns``, or the items that passed the
    per-item checks)."""

    __slots__ = ("index", "keys", "offsets", "sizes")

    def __init__(self, index: Sequence[int], keys: Sequence[bytes], offsets: Sequence[int],
                 sizes: Sequence[int]) -> None:
        self.index, self.keys, self.offsets, self.sizes = index, keys, offsets, sizes

    def groups(self, target: int, lead: int = 0) -> Iterator[Checked]:
        """One copy job each (batches are one chunk size): slices of the columns, no tuple per
        item. The first ``lead`` jobs (one per copy thread) of about ``target`` bytes, the rest
        in as few as keep ``lead`` threads busy (``job_bounds``), where a job holds at least
        GROW_MIN_ITEMS chunks; else (or ``lead`` 0) all of ``target``."""
        n = len(self.keys)
        size = max(1, self.sizes[0])
        step = max(1, target // size)
        if step >= n:
            yield self
            return
        if step < GROW_MIN_ITEMS:  # large chunks: jobs of ``target`` balance the threads
            lead = 0
        for first, end in job_bounds(n, step, lead, LARGE_JOB_BYTES // size):
            yield Checked(self.index[first:end], self.keys[first:end],
                          self.offsets[first:end], self.sizes[first:end])


Refused = Callable[[Batch, int, Status, bytes, Any, int], None]
_MISS = int(Status.MISS)
#: A GET item the arena missed: ``(batch, queue, index, key, offset, nbytes)``.
Missed = Callable[[Batch, JobQueue, int, bytes, Any, int], None]


def reserve_items(tier: CpuTier, batch: Batch, queue: JobQueue, items: Checked,
                  refused: Refused, submit_writes: Callable[[Batch, SlotWrites], None] | None
                  ) -> None:
    """Reserve and queue checked PUT items; ``refused`` answers an item the tier did not
    reserve (exists, parked for space, or failed). With ``submit_writes`` (nothing needs the
    chunks' entries: no kv-events, no tier below), a group of new keys is reserved by slot
    (``CpuTier.reserve_slots``) and copied as one ``SlotWrites`` job; what that leaves
    (an existing key, a full arena) is reserved as entries, which evicts or refuses as one
    ``reserve`` per item would."""
    session = batch.session
    space, fingerprint, owner = session.space, session.fingerprint, session.id
    for group in items.groups(queue.target, queue.lead):
        index, keys, offsets, sizes = group.index, group.keys, group.offsets, group.sizes
        nbytes = sizes[0]
        if submit_writes is not None and sizes.count(nbytes) == len(sizes):
            slots, dst = tier.reserve_slots(space, keys, nbytes, fingerprint)
            placed = len(slots)
            if placed:
                whole = placed == len(keys)
                submit_writes(batch, SlotWrites(
                    list(index if whole else index[:placed]),
                    list(keys if whole else keys[:placed]), slots,
                    list(offsets if whole else offsets[:placed]), dst, nbytes, placed * nbytes))
                if whole:
                    continue
                index, keys, offsets, sizes = (index[placed:], keys[placed:], offsets[placed:],
                                               sizes[placed:])
        reserved = tier.reserve_many(space, keys, sizes, fingerprint, owner)
        entries = [entry for _, entry in reserved]
        if None not in entries:  # every item reserved (a batch of new keys): the job in C
            queue.add_many(list(zip(index, entries, offsets)), sum(sizes))
            continue
        job = []
        job_bytes = 0
        for i, key, offset, size, (status, entry) in zip(index, keys, offsets, sizes, reserved):
            if entry is None:
                refused(batch, i, status, key, offset, size)
            else:
                job.append((i, entry, offset))
                job_bytes += size
        queue.add_many(job, job_bytes)


def get_items(tier: CpuTier, batch: Batch, queue: JobQueue, items: Checked,
              sessions: SessionTable, submit_reads: Callable[[Batch, SlotReads], None],
              missed: Missed) -> None:
    """Look up, acquire and queue checked GET items (an arena miss goes to ``missed``, another
    refusal is answered in ``results``). A hit
    the tier holds by slot goes into one ``SlotReads`` job per group (``submit_reads``); any other
    hit (several runs, or to be verified on its first read) into ``queue`` as an entry. An
    item's lease is released just before its group is acquired: never a window in which a copy
    completing inline could let an eviction take a chunk that is neither leased nor acquired."""
    session = batch.session
    results = batch.results
    for group in items.groups(queue.target, queue.lead):
        index, keys, offsets, sizes = group.index, group.keys, group.offsets, group.sizes
        if session.leases:  # a GET consumes the lease
            for key in keys:
                sessions.release_lease(session, (session.space, key))
        batch.ghost_keys.extend(keys)  # the read refreshes the key in the ghosts, hit or not
        found, held, pages = tier.acquire_slots(session.space, keys, sizes, session.fingerprint)
        if len(held) == len(keys):  # every item a hit held by slot: columns straight away
            submit_reads(batch, SlotReads(list(index), held, found, list(offsets), list(sizes),
                                          pages, sum(sizes)))
            continue
        reads = SlotReads([], held, [], [], [], pages, 0)
        job = []
        job_bytes = 0
        for i, key, offset, nbytes, got in zip(index, keys, offsets, sizes, found):
            if type(got) is not int:
                job.append((i, got, offset))
                job_bytes += nbytes
            elif got >= 0:
                reads.items.append(i)
                reads.src.append(got)
                reads.dst.append(offset)
                reads.sizes.append(nbytes)
                reads.nbytes += nbytes
            elif got == -_MISS:  # perhaps in a tier below
                missed(batch, queue, i, key, offset, nbytes)
            else:
                results[i] = -got
        if held:
            submit_reads(batch, reads)
        queue.add_many(job, job_bytes)
