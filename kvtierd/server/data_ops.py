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
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from kvtierd.config import Config
from kvtierd.copy import memcpy
from kvtierd.cuda_health import CudaContextLost
from kvtierd.events import NO_EVENTS, NoEvents
from kvtierd.copy.engine import CopyEngine
from kvtierd.ghost import GhostCaches
from kvtierd.metrics import DaemonMetrics
from kvtierd.protocol import Op, ProtocolError, Status, Tier, reply
from kvtierd.server import requests
from kvtierd.server.accounting import Accounting
from kvtierd.server.chain import TierChain
from kvtierd.server.sessions import Session, SessionTable
from kvtierd.tenants import TenantTable
from kvtierd.tiers.chunk import ChunkEntry, ChunkState

log = logging.getLogger(__name__)

MAX_ERRORS = 32  # per reply; results still carry every item's status


@dataclass(eq=False)
class Batch:
    """A PUT or GET whose jobs are in flight (or whose items wait for space)."""

    session: Session
    op: Op
    request_id: Any
    started: float
    results: list[int]
    errors: list[list]
    out_frames: list[Any] = field(default_factory=list)  # inline GET payloads
    jobs_left: int = 0
    failed: set[int] = field(default_factory=set)  # item indices whose copy raised
    deferred: bool = False  # the handler returned before the jobs completed
    parked: list[tuple[int, Any, Any, Any]] = field(default_factory=list)  # PUT items awaiting space
    frames: list = field(default_factory=list)  # inline PUT payloads
    inline_bytes: int = 0  # of the session's max_inline_reply_bytes, what this GET's reply holds
    blocks: list | None = None  # kv-events: PUT items' parsed ``blocks`` (kvtierd.event_blocks)

    @property
    def done(self) -> bool:
        return self.jobs_left == 0 and not self.parked


class DataOps:
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

    # -- PUT -----------------------------------------------------------------------------------------
    def put(self, session: Session, header: dict, frames: list) -> dict | None:
        items = requests.items(header, self.cfg.max_batch)
        batch = self._batch(session, Op.PUT, header)
        self._check_frames(session, items, frames)
        batch.frames = frames
        batch.blocks = requests.blocks(header, len(items))  # kv-events: what each item covers
        jobs: list[tuple[int, ChunkEntry, Any]] = []
        for i, (key, offset, nbytes) in enumerate(items):
            problem = (self._item_problem(session, key, offset, nbytes, frames, i)
                       or requests.block_problem(batch.blocks, i))
            if problem is not None:
                self._fail(batch, i, *problem)
                continue
            self._reserve_item(batch, jobs, i, key, offset, nbytes)
        if batch.parked:
            self.waiting.append(batch)
        self._submit(batch, jobs, self._put_job)
        return self._answer_now_or_later(batch)

    def _reserve_item(self, batch: Batch, jobs: list, i: int, key: bytes, offset: Any,
                      nbytes: int) -> None:
        session = batch.session
        ikey = session.ikey(key)
        below = self.mover.peek_below(ikey)
        if below is not None and ikey not in self.tier.index:
            status = self._existing_below(below, session.fingerprint, nbytes)
            if status is Status.EXISTS:
                self.ghosts.insert(ikey, nbytes)
            self._fail(batch, i, status, self._reserve_message(status, nbytes, session.tenant))
            return
        status, entry = self.tier.reserve(ikey, session.fingerprint, nbytes, session.id)
        if entry is None:
            if status is Status.EXISTS:
                self.ghosts.insert(ikey, nbytes)
            if status is Status.NO_SPACE and self.mover.space_coming():
                batch.parked.append((i, key, offset, nbytes))
                return
            self._fail(batch, i, status, self._reserve_message(status, nbytes, session.tenant))
            return
        session.pending.add(entry)
        jobs.append((i, entry, batch.frames[i] if session.staging is None else offset))

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
            jobs: list = []
            for n, (i, key, offset, nbytes) in enumerate(parked):
                if batch.parked:  # an earlier item is still short of space: keep the order
                    batch.parked.extend(parked[n:])
                    break
                if batch.session.closed:
                    self._fail(batch, i, Status.NO_SESSION, "the session ended; not done")
                elif batch.op is Op.PUT:
                    self._reserve_item(batch, jobs, i, key, offset, nbytes)
                else:
                    self._get_item(batch, jobs, i, key, offset, nbytes)
            self._submit(batch, jobs, self._put_job if batch.op is Op.PUT else self._get_job,
                         extend=True)
            if batch.parked:
                return  # still short of space: keep FIFO order
            self.waiting.popleft()
            self._maybe_finish(batch)

    # -- GET -----------------------------------------------------------------------------------------
    def get(self, session: Session, header: dict, frames: list) -> dict | None:
        items = requests.items(header, self.cfg.max_batch)
        batch = self._batch(session, Op.GET, header)
        if session.staging is None:
            batch.out_frames = [b""] * len(items)
            session.release_sent_replies()
        jobs: list[tuple[int, ChunkEntry, Any]] = []
        for i, (key, offset, nbytes) in enumerate(items):
            problem = self._item_problem(session, key, offset, nbytes, None, i)
            if problem is not None:
                self._fail(batch, i, *problem)
                continue
            self.sessions.release_lease(session, session.ikey(key))  # a GET consumes the lease
            self._get_item(batch, jobs, i, key, offset, nbytes)
        if batch.parked:
            self.waiting.append(batch)
        self._submit(batch, jobs, self._get_job)
        done = self._answer_now_or_later(batch)
        if done is not None and session.staging is None:
            self.finish(batch, done, deferred=False)  # sent tracked: its bytes count until sent
            return None
        return None if done is None else (done, batch.out_frames)

    def _get_item(self, batch: Batch, jobs: list, i: int, key: bytes, offset: Any,
                  nbytes: int) -> None:
        session = batch.session
        status, tier, entry = self.mover.lookup(session.ikey(key), session.fingerprint)
        if entry is not None and entry.nbytes and entry.nbytes != nbytes:  # 0: known by reading
            status, entry = Status.SIZE_MISMATCH, None
        # A read refreshes the key in the ghosts as in the tier, but the LOOKUP before it counted
        # this chunk request already (kvtierd.server.accounting).
        self.ghosts.touch(session.ikey(key))
        if entry is None:
            self._get_miss(batch, i, status)
        elif session.staging is None and not self._take_inline_budget(batch, nbytes):
            self.metrics.refused.labels("inline_reply_bytes").inc()
            self._fail(batch, i, Status.TOO_LARGE,
                       f"this session's inline GET replies would hold more than "
                       f"max_inline_reply_bytes ({self.cfg.max_inline_reply_bytes}); ask for "
                       "fewer or smaller chunks per GET, and read earlier replies")
        elif tier is not Tier.CPU:
            self._promote(batch, i, tier, entry, key, offset, nbytes)
        else:
            jobs.append(self._copy_out_job(batch, i, entry, offset))

    def _take_inline_budget(self, batch: Batch, nbytes: int) -> bool:
        session = batch.session
        if session.inline_reply_bytes + nbytes > self.cfg.max_inline_reply_bytes:
            return False
        session.inline_reply_bytes += nbytes
        batch.inline_bytes += nbytes
        return True

    def _get_miss(self, batch: Batch, i: int, status: Status, message: str = "") -> None:
        if message:
            self._fail(batch, i, status, message)
        else:
            batch.results[i] = int(status)

    def _copy_out_job(self, batch: Batch, i: int, entry: ChunkEntry, offset: Any) -> tuple:
        self.tier.acquire(entry)
        if batch.session.staging is None:
            batch.out_frames[i] = bytearray(entry.nbytes)
            return (i, entry, batch.out_frames[i])
        return (i, entry, offset)

    def _promote(self, batch: Batch, i: int, tier: Tier, source: ChunkEntry, key: bytes,
                 offset: Any, nbytes: int) -> None:
        status, target = self.tier.reserve(source.ikey, source.fingerprint, nbytes, 0)
        if target is None:
            if status is Status.NO_SPACE and self.mover.space_coming():
                batch.parked.append((i, key, offset, nbytes))
                if batch.session.staging is None:  # taken again when the item is retried
                    batch.session.inline_reply_bytes -= nbytes
                    batch.inline_bytes -= nbytes
                return
            why = (self._reserve_message(status, nbytes, batch.session.tenant)
                   if status is Status.QUOTA_EXCEEDED else "no room in the CPU tier")
            self._get_miss(batch, i, status,
                           f"cannot promote this {tier.name.lower()} chunk: {why}")
            return
        batch.jobs_left += 1
        batch.session.in_flight += 1

        def done(ok: bool, why: str) -> None:
            # The chain committed the target (ok) or aborted it (failed its check, unreadable,
            # or DELETEd while being read).
            batch.session.in_flight -= 1
            batch.jobs_left -= 1
            if not ok:
                self._get_miss(batch, i, Status.CHECKSUM_MISMATCH, f"{why}; not served")
            elif not batch.session.closed:
                self._submit(batch, [self._copy_out_job(batch, i, target, offset)],
                             self._get_job, extend=True)
            else:  # promoted for the next reader; this one is gone and was served nothing
                self._fail(batch, i, Status.NO_SESSION, "the session ended during promotion")
            self.sessions.release_staging(batch.session)
            self._maybe_finish(batch)
            if self.waiting:
                self.retry_parked()

        self.mover.promote(tier, source, target, done)

    # -- shared --------------------------------------------------------------------------------------
    def _batch(self, session: Session, op: Op, header: dict) -> Batch:
        count = len(header["items"])
        return Batch(session, op, header.get("id"), time.perf_counter(), [0] * count, [])

    def _check_frames(self, session: Session, items: list, frames: list) -> None:
        # Shared staging needs no per-batch size check: a memfd is sealed against shrinking and a
        # device allocation cannot shrink (kvtierd.staging).
        if session.staging is None and len(frames) != len(items):
            raise ProtocolError(
                Status.BAD_REQUEST,
                f"an inline PUT needs one payload frame per item: {len(items)} items, "
                f"{len(frames)} frames",
            )

    def _item_problem(
        self, session: Session, key: Any, offset: Any, nbytes: Any, frames: list | None, i: int
    ) -> tuple[Status, str] | None:
        problem = requests.key_problem(key)
        if problem is not None:
            return problem
        problem = requests.nbytes_problem(nbytes)
        if problem is not None:
            return problem
        if session.staging is not None:
            why = session.staging.check_range(offset, nbytes)
            return (Status.OUT_OF_BOUNDS, why) if why else None
        problem = requests.offset_problem(offset)
        if problem is not None:
            return problem
        if nbytes > self.cfg.max_inline_bytes:
            return (
                Status.TOO_LARGE,
                f"inline chunk of {nbytes} bytes is above max_inline_bytes "
                f"({self.cfg.max_inline_bytes})",
            )
        if frames is not None and len(frames[i]) != nbytes:
            return (
                Status.SIZE_MISMATCH,
                f"payload frame has {len(frames[i])} bytes, item says {nbytes}",
            )
        return None

    def _reserve_message(self, status: Status, nbytes: int, tenant: str) -> str:
        if status is Status.QUOTA_EXCEEDED:
            self.metrics.quota_rejections.labels(self.tenants.label(tenant)).inc()
            page = self.tier.page_bytes
            return (
                f"tenant {tenant} is over its quota: {self.tier.tenant_used_pages(tenant) * page}"
                f" of {self.tier.quota_pages(tenant) * page} bytes used, {nbytes} more asked, and"
                " its own chunks that could be evicted do not make enough room"
            )
        if status is Status.NO_SPACE:
            return (
                f"no room for {nbytes} bytes: the CPU tier is full of chunks that are pending, "
                "leased or being read"
            )
        if status is Status.TOO_LARGE:
            return f"chunk of {nbytes} bytes is larger than the CPU tier ({self.tier.capacity_bytes})"
        if status is Status.LAYOUT_MISMATCH:
            return "key is stored with another layout fingerprint; the stored chunk is kept"
        if status is Status.SIZE_MISMATCH:
            return "key is stored with another size by the same layout; the stored chunk is kept"
        if status is Status.BUSY:
            return "a PUT of this key is already in flight"
        return ""  # EXISTS: a successful no-op, no message

    def _fail(self, batch: Batch, index: int, status: Status, message: str) -> None:
        batch.results[index] = int(status)
        if message and len(batch.errors) < MAX_ERRORS:
            batch.errors.append([index, status.name, message])

    # -- copies --------------------------------------------------------------------------------------
    def _submit(self, batch: Batch, jobs: list, job_fn: Callable, extend: bool = False) -> None:
        """Split ``jobs`` into at most ``copy_threads`` byte-balanced parts and run them."""
        if not jobs:
            if not extend:
                batch.deferred = not batch.done
            return
        parts = min(self.cfg.copy_threads, len(jobs))
        buckets: list[list] = [[] for _ in range(parts)]
        loads = [0] * parts
        for job in sorted(jobs, key=lambda j: -j[1].nbytes):
            k = loads.index(min(loads))
            buckets[k].append(job)
            loads[k] += job[1].nbytes
        batch.jobs_left += parts
        batch.session.in_flight += parts
        for bucket, nbytes in zip(buckets, loads):
            done = self.engine.submit(nbytes, lambda b=bucket: job_fn(batch.session, b),
                                      (batch, bucket))
            if done is not None:
                self.on_copy_done(*done)
        if not extend:
            batch.deferred = not batch.done

    def _put_job(self, session: Session, bucket: list) -> list[bytes]:
        arena = self.tier.arena
        sums = []
        for _, entry, source in bucket:
            segs = self.tier.segments(entry)
            if session.staging is None:
                sums.append(_copy_frame_in(memoryview(source), arena, segs))
            else:
                sums.append(session.staging.copy_in(source, arena, segs))
        return sums

    def _get_job(self, session: Session, bucket: list) -> set[int]:
        """Copy every entry out; return the bucket positions that failed their first-read check."""
        arena = self.tier.arena
        bad: set[int] = set()
        for pos, (_, entry, target) in enumerate(bucket):
            segs = self.tier.segments(entry)
            if not entry.verified and memcpy.checksum(arena.view, segs) != entry.checksum:
                bad.add(pos)
                continue
            if session.staging is None:
                _copy_out_to_frame(arena, segs, target)
            else:
                session.staging.copy_out(arena, segs, target)
        return bad

    def on_copy_done(self, context: tuple[Batch, list], result: Any, error: BaseException | None):
        batch, bucket = context
        session = batch.session
        if isinstance(error, CudaContextLost):  # logged once, as CRITICAL, by cuda_health
            log.error("copy for %s batch of session %d failed: %s", batch.op.name, session.id,
                      error)
        elif error is not None:
            log.error("copy for %s batch of session %d failed", batch.op.name, session.id,
                      exc_info=error)
        for pos, (index, entry, _) in enumerate(bucket):
            if batch.op is Op.PUT:
                self._finish_put_item(batch, index, entry, None if error else result[pos], error)
            else:
                corrupt = error is None and pos in result
                self._finish_get_item(batch, index, entry, error, corrupt)
        batch.jobs_left -= 1
        session.in_flight -= 1
        self.sessions.release_staging(session)
        self._maybe_finish(batch)
        if self.waiting:
            self.retry_parked()  # commits made chunks evictable, releases and aborts free pages

    def _maybe_finish(self, batch: Batch) -> None:
        if batch.done and batch.deferred:
            # Answered even if the session ended meanwhile (BYE right behind a PUT): its peer may
            # still be there, and every request gets a reply.
            batch.deferred = False
            self.finish(batch, self._reply_if_done(batch))

    def _finish_put_item(self, batch: Batch, index: int, entry: ChunkEntry, digest,
                         error: BaseException | None = None) -> None:
        batch.session.pending.discard(entry)
        if digest is None or batch.session.closed:
            self.tier.abort(entry)
            if isinstance(error, CudaContextLost):
                self._fail(batch, index, Status.SHUTTING_DOWN, str(error))
            elif digest is None:
                self._fail(batch, index, Status.INTERNAL, "copy into the CPU tier failed")
            else:
                self._fail(batch, index, Status.NO_SESSION,
                           "the session ended before the copy completed; not stored")
            return
        self.tier.commit(entry, digest)
        self.events.stored(entry.ikey, "cpu", batch.blocks[index] if batch.blocks else None)
        self.ghosts.insert(entry.ikey, entry.nbytes)
        self.metrics.bytes.labels("in", "cpu").inc(entry.nbytes)
        self.mover.after_commit(entry)

    def _finish_get_item(self, batch: Batch, index: int, entry: ChunkEntry,
                         error: BaseException | None, corrupt: bool) -> None:
        self.tier.release(entry)
        if error is None and not corrupt:
            entry.verified = True
            self.metrics.bytes.labels("out", "cpu").inc(entry.nbytes)
            self.mover.after_read(entry)
            return
        if batch.out_frames:
            batch.out_frames[index] = b""
        if corrupt:
            self.metrics.integrity_failures.labels("cpu").inc()
            log.error("chunk %r failed its checksum after a warm restart; dropped", entry.ikey)
            self.mover.drop_cpu(entry)
            self._fail(batch, index, Status.CHECKSUM_MISMATCH, "stored bytes failed their check")
        elif isinstance(error, CudaContextLost):
            self._fail(batch, index, Status.SHUTTING_DOWN, str(error))
        else:
            self._fail(batch, index, Status.INTERNAL, "copy out of the CPU tier failed")

    def _answer_now_or_later(self, batch: Batch) -> dict | None:
        done = self._reply_if_done(batch)
        if done is None:
            batch.session.batches_in_flight += 1  # until finish: max_in_flight_requests
        return done

    def _reply_if_done(self, batch: Batch) -> dict | None:
        if not batch.done:
            return None
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
        header = reply(batch.request_id, Status.OK, **fields)
        tracker = self.send(session.identity, header, batch.out_frames,
                            track=batch.inline_bytes > 0)
        if batch.inline_bytes:
            session.inline_replies.append((tracker, batch.inline_bytes))
            session.release_sent_replies()
        op = batch.op.name.lower()
        self.metrics.requests.labels(op, "OK").inc()
        self.metrics.latency.labels(op).observe(time.perf_counter() - batch.started)


def _copy_frame_in(payload: memoryview, arena: Any, segs: list[tuple[int, int]]) -> bytes:
    pos = 0
    for offset, length in segs:
        arena.view[offset : offset + length] = payload[pos : pos + length]
        pos += length
    return memcpy.checksum(arena.view, segs)


def _copy_out_to_frame(arena: Any, segs: list[tuple[int, int]], target: bytearray) -> None:
    pos = 0
    for offset, length in segs:
        target[pos : pos + length] = arena.view[offset : offset + length]
        pos += length
