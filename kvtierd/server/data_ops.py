"""PUT and GET: the ops that move bytes. Each returns a reply (and frames) or ``None`` while copies
are in flight; the batch is then answered by ``finish`` when its last job completes.

PUT: reserve every item in the CPU tier (PENDING) → copy staging → arena (+ checksum) → commit, or
abort if the copy failed or the session ended meanwhile. An item that finds the arena full while
demotions to NVMe are in flight is *parked* (not failed) and retried as pages come back, so a burst
larger than the watermark headroom is slowed down, not refused.

GET: a CPU hit is acquired and copied arena → staging. A hit in a lower tier (NVMe, remote) is
first promoted: arena pages are reserved, the tier chain reads and verifies them and commits the
chunk to the arena (its copy below stays), then it is copied out like a CPU hit. Per-item outcomes
go into ``results`` with a message per failure in ``errors``; one bad item never fails its
neighbours.

Cost per item is what limits small chunks (at 16 KiB a memcpy takes ~3 µs), so the per-item path
does only what is per item — validate, reserve or look up, queue the copy — and everything else
is done once per batch or per copy job: copies go out in jobs of a few MiB while later items are
still being reserved (``kvtierd.server.batch``), a job's completion commits or releases its
chunks in one pass, and metrics, hit accounting and the ghost feed are updated per job or per
reply, with the same counts per scrape as per-item updates would give. Without lower tiers and
with shared staging (the common case), checked items are reserved or looked up a job's worth per
call of the CPU tier's batch primitives (``kvtierd.server.fast_path``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from functools import partial
from typing import Any, Callable, Sequence

from kvtierd.config import Config
from kvtierd.copy import jobs as copy_jobs
from kvtierd.copy.engine import CopyEngine
from kvtierd.cuda_health import CudaContextLost
from kvtierd.events import NO_EVENTS, NoEvents
from kvtierd.ghost import GhostCaches
from kvtierd.metrics import DaemonMetrics
from kvtierd.protocol import MAX_KEY_BYTES, Op, ProtocolError, Status, Tier, reply
from kvtierd.server import fast_path, requests
from kvtierd.server.accounting import Accounting
from kvtierd.server.batch import (MAX_JOB_BYTES, Batch, JobQueue, SlotReads, SlotWrites,
                                  job_bytes)
from kvtierd.server.chain import TierChain
from kvtierd.server.job_done import JobCompletions
from kvtierd.server.refusals import reserve_message
from kvtierd.server.sessions import Session, SessionTable
from kvtierd.tenants import TenantTable
from kvtierd.tiers.chunk import ChunkEntry, ChunkState

log = logging.getLogger(__name__)
_OK, _MISS = int(Status.OK), int(Status.MISS)


class DataOps(JobCompletions):
    def __init__(self, cfg: Config, mover: TierChain, sessions: SessionTable, engine: CopyEngine,
                 metrics: DaemonMetrics, accounting: Accounting,
                 send: Callable[..., Any], tenants: TenantTable) -> None:
        self.cfg = cfg
        self.tenants = tenants
        self.tier = mover.cpu
        self.mover = mover
        self.sessions = sessions
        self.engine = engine
        self.metrics = metrics
        self.accounting = accounting
        self.ghosts = GhostCaches([], cfg.page_bytes)  # the daemon sets the real ones
        self.send = send
        self.events: NoEvents = NO_EVENTS  # kv-events hook: set by the daemon
        self.waiting: deque[Batch] = deque()  # PUTs with parked items, oldest first
        self._retrying = False
        mover.on_space = self.retry_parked
        self._bytes_in = metrics.bytes.labels("in", "cpu")
        self._bytes_out = metrics.bytes.labels("out", "cpu")

    # -- PUT -----------------------------------------------------------------------------------------
    def put(self, session: Session, header: dict, frames: list) -> dict | None:
        items = requests.items(header, self.cfg.max_batch)
        batch = self._batch(session, Op.PUT, header)
        self._check_frames(session, items, frames)
        batch.frames = frames
        batch.blocks = blocks = requests.blocks(header, len(items))  # kv-events: what items cover
        queue = self._queue(batch, job_bytes(items, self.cfg.copy_threads))
        staging = session.staging
        limit = staging.nbytes if staging is not None else -1  # inline: the checked path below
        # With shared staging (the common case), an item is one reserve and one queued copy,
        # written out here: no call per item beyond the tier's. A batch of which a lower tier
        # holds some key goes item by item (``_reserve_item``: answered from below).
        fast = staging is not None
        if fast and blocks is None:
            columns = requests.common_columns(items, limit)
            if columns is not None and not self._held_below(session, columns[0]):
                fast_path.reserve_items(self.tier, batch, queue,  # every item checked in C
                                        fast_path.Checked(range(len(items)), *columns),
                                        self._refused, self._writes_by_slot())
                return self._built(batch, queue)
        valid: list[tuple[int, bytes, int, int]] = []  # fast: the items to reserve, in order
        for i, (key, offset, nbytes) in enumerate(items):
            # The common case in one expression; anything else gets its exact message below.
            if not (type(key) is bytes and 0 < len(key) <= MAX_KEY_BYTES and type(nbytes) is int
                    and type(offset) is int and 0 <= offset and 0 < nbytes
                    and offset + nbytes <= limit):
                problem = requests.item_problem(staging, key, offset, nbytes,
                                                frames[i] if staging is None else None,
                                                self.cfg.max_inline_bytes)
                if problem is not None:
                    batch.fail(i, *problem)
                    continue
            if blocks is not None:
                problem = requests.block_problem(blocks, i)
                if problem is not None:
                    batch.fail(i, *problem)
                    continue
            if fast:
                valid.append((i, key, offset, nbytes))
            else:
                self._reserve_item(batch, queue, i, key, offset, nbytes)
        if valid and self._held_below(session, [key for _, key, _, _ in valid]):
            for i, key, offset, nbytes in valid:
                self._reserve_item(batch, queue, i, key, offset, nbytes)
        elif valid:
            fast_path.reserve_items(self.tier, batch, queue, fast_path.Checked(*zip(*valid)),
                                    self._refused, self._writes_by_slot())
        return self._built(batch, queue)

    def _held_below(self, session: Session, keys: Sequence[bytes]) -> bool:
        """Whether a usable local lower tier holds any of ``keys`` (``peek_below``'s answer, per
        batch). A shared (remote) tier's chunks are not on this node: a PUT stores them here."""
        return any(self.mover.usable(link) and not link.tier.shared
                   and link.tier.holds_any(session.space, keys) for link in self.mover.links)

    def _writes_by_slot(self) -> Callable[[Batch, SlotWrites], None] | None:
        """How the fast path submits reservations held by slot, if it may make them (nothing
        wants a PUT's chunks as entries: ``_plain_commits``)."""
        return self._submit_writes if self._plain_commits() else None

    def _reserve_item(self, batch: Batch, queue: JobQueue, i: int, key: bytes, offset: Any,
                      nbytes: int) -> None:
        session = batch.session
        ikey = (session.space, key)
        if self.mover.links:
            below = self.mover.peek_below(ikey, local=True)
            if below is not None and ikey not in self.tier.index:
                status = self._existing_below(below, session.fingerprint, nbytes)
                if status is Status.EXISTS:
                    batch.ghost_keys.append(key)
                    batch.ghost_nbytes.append(nbytes)
                batch.fail(i, status, self._reserve_message(status, nbytes, session.tenant))
                return
        status, entry = self.tier.reserve(ikey, session.fingerprint, nbytes, session.id)
        if entry is None:
            self._refused(batch, i, status, key, offset, nbytes)
            return
        queue.add((i, entry, batch.frames[i] if session.staging is None else offset), nbytes)

    def _refused(self, batch: Batch, i: int, status: Status, key: bytes, offset: Any,
                 nbytes: int) -> None:
        """The CPU tier did not reserve item ``i``: already there (a no-op that still feeds the
        ghosts), parked until space comes back, or failed with the reason."""
        if status is Status.EXISTS:
            batch.ghost_keys.append(key)
            batch.ghost_nbytes.append(nbytes)
        if status is Status.NO_SPACE and self.mover.space_coming():
            batch.parked.append((i, key, offset, nbytes))
            return
        batch.fail(i, status, self._reserve_message(status, nbytes, batch.session.tenant))

    @staticmethod
    def _existing_below(entry: ChunkEntry, fingerprint: str, nbytes: int) -> Status:
        if entry.fingerprint != fingerprint:
            return Status.LAYOUT_MISMATCH
        if entry.nbytes != nbytes:
            return Status.SIZE_MISMATCH
        return Status.EXISTS if entry.state is ChunkState.READY else Status.BUSY

    def retry_parked(self) -> None:
        """Pages came back: reserve parked PUT items, oldest batch first."""
        if self._retrying:
            return  # re-entered from a copy that completed inline below: the outer call goes on
        self._retrying = True
        try:
            self._retry_parked()
        finally:
            self._retrying = False

    def _retry_parked(self) -> None:
        while self.waiting:
            batch = self.waiting[0]
            parked, batch.parked = batch.parked, []
            batch.building = True  # not answered from a completion while items are re-added
            queue = self._queue(batch, MAX_JOB_BYTES)
            for n, (i, key, offset, nbytes) in enumerate(parked):
                if batch.parked:  # an earlier item is still short of space: keep the order
                    batch.parked.extend(parked[n:])
                    break
                if batch.session.closed:
                    batch.fail(i, Status.NO_SESSION, "the session ended; not done")
                elif batch.op is Op.PUT:
                    self._reserve_item(batch, queue, i, key, offset, nbytes)
                else:
                    self._get_item(batch, queue, i, key, offset, nbytes)
            queue.flush()
            batch.building = False
            self._feed_ghosts(batch)
            if batch.parked:
                return  # still short of space: keep FIFO order
            self.waiting.popleft()
            self._maybe_finish(batch)

    # -- GET -----------------------------------------------------------------------------------------
    def get(self, session: Session, header: dict, frames: list) -> dict | None:
        items = requests.items(header, self.cfg.max_batch)
        batch = self._batch(session, Op.GET, header)
        staging = session.staging
        if staging is None:
            batch.out_frames = [b""] * len(items)
            session.release_sent_replies()
        queue = self._queue(batch, job_bytes(items, self.cfg.copy_threads))
        # Shared staging and no admission filter below (reads counted chunk by chunk): looked up
        # as columns in the arena, and what it misses in the tiers below, item by item.
        fast = not self.mover.counts_reads and staging is not None
        columns = requests.common_columns(items, staging.nbytes) if fast else None
        if columns is not None:  # every item checked in C loops
            fast_path.get_items(self.tier, batch, queue,
                                fast_path.Checked(range(len(items)), *columns), self.sessions,
                                self._submit_reads, self._get_below)
        else:
            self._get_each(batch, queue, items, fast)
        done = self._built(batch, queue)
        if done is not None and staging is None:
            self.finish(batch, done, deferred=False)  # sent tracked: its bytes count until sent
            return None
        return None if done is None else (done, batch.out_frames)

    def _get_each(self, batch: Batch, queue: JobQueue, items: list, fast: bool) -> None:
        """GET items checked one by one (some item is not the common case, or lower tiers or
        inline replies): each refused with its exact message, or looked up (``fast``: the valid
        ones as columns afterwards)."""
        session = batch.session
        staging, leases = session.staging, session.leases
        limit = staging.nbytes if staging is not None else -1
        valid: list[tuple[int, bytes, int, int]] = []  # fast: the items to look up, in order
        for i, (key, offset, nbytes) in enumerate(items):
            if not (type(key) is bytes and 0 < len(key) <= MAX_KEY_BYTES and type(nbytes) is int
                    and type(offset) is int and 0 <= offset and 0 < nbytes
                    and offset + nbytes <= limit):
                problem = requests.item_problem(staging, key, offset, nbytes, None,
                                                self.cfg.max_inline_bytes)
                if problem is not None:
                    batch.fail(i, *problem)
                    continue
            if fast:  # its lease is consumed right before its lookup, as below
                valid.append((i, key, offset, nbytes))
                continue
            if leases:  # a GET consumes the lease
                self.sessions.release_lease(session, (session.space, key))
            self._get_item(batch, queue, i, key, offset, nbytes)
        if valid:
            fast_path.get_items(self.tier, batch, queue, fast_path.Checked(*zip(*valid)),
                                self.sessions, self._submit_reads, self._get_below)

    def _get_item(self, batch: Batch, queue: JobQueue, i: int, key: bytes, offset: Any,
                  nbytes: int) -> None:
        session = batch.session
        if not self.mover.links:  # the chain's lookup without lower tiers: one call less
            status, entry = self.tier.lookup((session.space, key), session.fingerprint)
            tier = Tier.CPU
        else:
            status, tier, entry = self.mover.lookup((session.space, key), session.fingerprint)
        # A read refreshes the key in the ghosts as in the tier, but the LOOKUP before it counted
        # this chunk request already (kvtierd.server.accounting).
        batch.ghost_keys.append(key)
        self._serve(batch, queue, i, key, offset, nbytes, status, tier, entry)

    def _get_below(self, batch: Batch, queue: JobQueue, i: int, key: bytes, offset: Any,
                   nbytes: int) -> None:
        """Item ``i``, which the arena missed in the fast path (its ghosts fed there): the rest
        of the chain's ``lookup``, then served as ``_get_item`` serves it."""
        session = batch.session
        if not self.mover.links:
            batch.results[i] = int(Status.MISS)
            return
        status, tier, entry = self.mover.lookup_below((session.space, key), session.fingerprint)
        self._serve(batch, queue, i, key, offset, nbytes, status, tier, entry)

    def _serve(self, batch: Batch, queue: JobQueue, i: int, key: bytes, offset: Any,
               nbytes: int, status: Status, tier: Tier, entry: ChunkEntry | None) -> None:
        """Answer or queue GET item ``i`` from what the lookup found (``tier``'s ``entry``)."""
        session = batch.session
        if entry is None:
            batch.results[i] = int(status)
        elif entry.nbytes and entry.nbytes != nbytes:  # 0: a lower tier knows it by reading it
            batch.results[i] = int(Status.SIZE_MISMATCH)
        elif tier is not Tier.CPU:
            if session.staging is None and not self._take_inline_budget(batch, i, nbytes):
                return
            self._promote(batch, i, tier, entry, key, offset, nbytes)
        elif session.staging is None:
            if self._take_inline_budget(batch, i, nbytes):
                self.tier.acquire(entry)
                batch.out_frames[i] = frame = bytearray(nbytes)
                queue.add((i, entry, frame), nbytes)
        else:
            self.tier.acquire(entry)
            queue.add((i, entry, offset), nbytes)

    def _take_inline_budget(self, batch: Batch, i: int, nbytes: int) -> bool:
        session = batch.session
        if session.inline_reply_bytes + nbytes > self.cfg.max_inline_reply_bytes:
            self.metrics.refused.labels("inline_reply_bytes").inc()
            batch.fail(i, Status.TOO_LARGE,
                       f"this session's inline GET replies would hold more than "
                       f"max_inline_reply_bytes ({self.cfg.max_inline_reply_bytes}); ask for "
                       "fewer or smaller chunks per GET, and read earlier replies")
            return False
        session.inline_reply_bytes += nbytes
        batch.inline_bytes += nbytes
        return True

    def _promote(self, batch: Batch, i: int, tier: Tier, source: ChunkEntry, key: bytes,
                 offset: Any, nbytes: int) -> None:
        status, target = self.tier.reserve(source.ikey, source.fingerprint, nbytes, 0,
                                           self.mover.link(tier).tier.read_slack_bytes)
        if target is None:
            if status is Status.NO_SPACE and self.mover.space_coming():
                batch.parked.append((i, key, offset, nbytes))
                if batch.session.staging is None:  # taken again when the item is retried
                    batch.session.inline_reply_bytes -= nbytes
                    batch.inline_bytes -= nbytes
                return
            why = (self._reserve_message(status, nbytes, batch.session.tenant)
                   if status is Status.QUOTA_EXCEEDED else "no room in the CPU tier")
            batch.fail(i, status, f"cannot promote this {tier.name.lower()} chunk: {why}")
            return
        batch.jobs_left += 1
        batch.session.in_flight += 1
        self.mover.promote(tier, source, target, partial(self._promoted, batch, i, target, offset))

    def _promoted(self, batch: Batch, i: int, target: ChunkEntry, offset: Any, ok: bool,
                  why: str) -> None:
        """The chain committed ``target`` (ok) or aborted it (failed its check, unreadable, or
        DELETEd while being read)."""
        batch.session.in_flight -= 1
        batch.jobs_left -= 1
        if not ok:
            batch.fail(i, Status.CHECKSUM_MISMATCH, f"{why}; not served")
        else:
            if not batch.session.closed:
                self.tier.acquire(target)
                if batch.session.staging is None:
                    batch.out_frames[i] = offset = bytearray(target.nbytes)
                self._submit(batch, [(i, target, offset)], target.nbytes)
            else:  # promoted for the next reader; this one is gone and was served nothing
                batch.fail(i, Status.NO_SESSION, "the session ended during promotion")
        self.sessions.release_staging(batch.session)
        self._maybe_finish(batch)
        if self.waiting:
            self.retry_parked()

    # -- shared --------------------------------------------------------------------------------------
    def _batch(self, session: Session, op: Op, header: dict) -> Batch:
        count = len(header["items"])
        return Batch(session, op, header.get("id"), time.perf_counter(), [0] * count, [])

    def _queue(self, batch: Batch, target: int) -> JobQueue:
        return JobQueue(partial(self._submit, batch), target, self.cfg.copy_threads)

    def _built(self, batch: Batch, queue: JobQueue) -> dict | None:
        """The handler added every item: submit the last job; the reply now, or None (later)."""
        queue.flush()
        self._feed_ghosts(batch)
        batch.building = False
        if batch.parked:
            self.waiting.append(batch)
        batch.deferred = not batch.done
        return self._answer_now_or_later(batch)

    def _check_frames(self, session: Session, items: list, frames: list) -> None:
        # Shared staging needs no per-batch size check: a memfd is sealed against shrinking and a
        # device allocation cannot shrink (kvtierd.staging).
        if session.staging is None and len(frames) != len(items):
            raise ProtocolError(
                Status.BAD_REQUEST,
                f"an inline PUT needs one payload frame per item: {len(items)} items, "
                f"{len(frames)} frames",
            )

    def _reserve_message(self, status: Status, nbytes: int, tenant: str) -> str:
        return reserve_message(self.tier, self.tenants, self.metrics, status, nbytes, tenant)

    def _feed_ghosts(self, batch: Batch) -> None:
        """Hand the ghosts what this batch step stored (PUT) or read (GET), in one call."""
        if not batch.ghost_keys:
            return
        keys, batch.ghost_keys = batch.ghost_keys, []
        if batch.op is Op.PUT:
            sizes, batch.ghost_nbytes = batch.ghost_nbytes, []
            self.ghosts.insert_many(batch.session.space, keys, sizes)
        else:
            self.ghosts.touch_many(batch.session.space, keys)

    # -- copies --------------------------------------------------------------------------------------
    def _submit(self, batch: Batch, job: list, nbytes: int) -> None:
        """Run one copy job of ``batch`` (inline if small: kvtierd.copy.engine)."""
        fn = copy_jobs.copy_in if batch.op is Op.PUT else copy_jobs.copy_out
        self._run_job(batch, job, nbytes, partial(fn, batch.session.staging, self.tier.arena,
                                                  self.tier.segments, job))

    def _submit_writes(self, batch: Batch, writes: SlotWrites) -> None:
        """Run one PUT job of reservations held by slot (inline if small)."""
        self._run_job(batch, writes, writes.total, partial(
            copy_jobs.copy_writes_in, batch.session.staging, self.tier.arena, writes))

    def _submit_reads(self, batch: Batch, reads: SlotReads) -> None:
        """Run one GET job of chunks held by slot (inline if small)."""
        self._run_job(batch, reads, reads.nbytes, partial(
            copy_jobs.copy_reads_out, batch.session.staging, self.tier.arena, reads))

    def _run_job(self, batch: Batch, job: Any, nbytes: int, copy: Callable[[], Any]) -> None:
        batch.jobs_left += 1
        batch.session.in_flight += 1
        done = self.engine.submit(nbytes, copy, (batch, job))
        if done is not None:
            self.on_copy_done(*done)

    def on_copy_done(self, context: tuple[Batch, list], result: Any, error: BaseException | None):
        batch, job = context
        session = batch.session
        if isinstance(error, CudaContextLost):  # logged once, as CRITICAL, by cuda_health
            log.error("copy for %s batch of session %d failed: %s", batch.op.name, session.id,
                      error)
        elif error is not None:
            log.error("copy for %s batch of session %d failed", batch.op.name, session.id,
                      exc_info=error)
        if batch.op is Op.PUT:
            self._put_job_done(batch, job, result, error)
        else:
            self._get_job_done(batch, job, result, error)
        batch.jobs_left -= 1
        session.in_flight -= 1
        self.sessions.release_staging(session)
        self._maybe_finish(batch)
        if self.waiting:
            self.retry_parked()  # commits made chunks evictable, releases and aborts free pages

    # -- replies -------------------------------------------------------------------------------------
    def _maybe_finish(self, batch: Batch) -> None:
        if batch.done and batch.deferred:
            # Answered even if the session ended meanwhile (BYE right behind a PUT): its peer may
            # still be there, and every request gets a reply.
            batch.deferred = False
            self.finish(batch, self._reply_if_done(batch))

    def _answer_now_or_later(self, batch: Batch) -> dict | None:
        done = self._reply_if_done(batch)
        if done is None:
            batch.session.batches_in_flight += 1  # until finish: max_in_flight_requests
        return done

    def _reply_if_done(self, batch: Batch) -> dict | None:
        if not batch.done:
            return None
        self._feed_ghosts(batch)  # what its jobs committed: one ghost call per batch, not per job
        if batch.op is Op.PUT:
            self.tier.enforce_watermarks()
        else:  # counted here, once per batch: exactly what the client is told per item
            self.accounting.get_results(batch.results)
        return {"results": batch.results, "errors": batch.errors}

    def finish(self, batch: Batch, fields: dict, deferred: bool = True) -> None:
        """Send the reply of a batch whose jobs completed after its handler returned (or of an
        inline GET, whose payload counts against max_inline_reply_bytes until libzmq sent it)."""
        session = batch.session
        if deferred:
            session.batches_in_flight -= 1
        if session.closed and batch.op is Op.GET:
            # Its routing id may be another peer's by now (libzmq lets a peer claim any id): a
            # closed session's GET reply says nothing of what it found and carries no bytes.
            fields = {**fields, "results": [_MISS if r == _OK else r for r in fields["results"]]}
            batch.out_frames = [b""] * len(batch.out_frames)
            batch.inline_bytes = 0
        header = reply(batch.request_id, Status.OK, **fields)
        tracker = self.send(session.identity, header, batch.out_frames,
                            track=batch.inline_bytes > 0)
        if batch.inline_bytes:
            session.inline_replies.append((tracker, batch.inline_bytes))
            session.release_sent_replies()
        op = batch.op.name.lower()
        self.metrics.requests.labels(op, "OK").inc()
        self.metrics.latency.labels(op).observe(time.perf_counter() - batch.started)
