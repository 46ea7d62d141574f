"""One method per op. Each returns a reply header (and payload frames), or ``None`` when copies are
in flight: the batch is then answered by ``finish`` once its last copy completes.

PUT: reserve every item (PENDING) → copy staging → arena (+ checksum) → commit, or abort if the copy
failed or the session ended meanwhile. GET: look up and acquire every item → copy arena → staging →
release. Per-item outcomes go into ``results`` (a ``Status`` per item) with a message for each
failure in ``errors``; one bad item never fails its neighbours.
"""

from __future__ import annotations

import hmac
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from kvtierd import __version__
from kvtierd.config import Config
from kvtierd.copy import memcpy
from kvtierd.copy.engine import CopyEngine
from kvtierd.metrics import DaemonMetrics
from kvtierd.protocol import (
    MAX_KEY_BYTES,
    PROTOCOL_VERSION,
    Op,
    ProtocolError,
    Status,
    Tier,
    reply,
)
from kvtierd.server import requests
from kvtierd.server.sessions import Session, SessionTable
from kvtierd.staging import ShmStaging
from kvtierd.tiers.chunk import ChunkEntry
from kvtierd.tiers.cpu import CpuTier

log = logging.getLogger(__name__)

MAX_ERRORS = 32  # per reply; results still carry every item's status


@dataclass(eq=False)
class Batch:
    """A PUT or GET whose copies are in flight."""

    session: Session
    op: Op
    request_id: Any
    started: float
    results: list[int]
    errors: list[list]
    entries: list[tuple[int, ChunkEntry]] = field(default_factory=list)
    out_frames: list[Any] = field(default_factory=list)  # inline GET payloads
    jobs_left: int = 0
    failed: set[int] = field(default_factory=set)  # item indices whose copy raised
    deferred: bool = False  # the handler returned before the copies completed


class OpHandlers:
    def __init__(
        self,
        cfg: Config,
        tier: CpuTier,
        sessions: SessionTable,
        engine: CopyEngine,
        metrics: DaemonMetrics,
        send: Callable[[bytes, dict, list], None],
    ) -> None:
        self.cfg = cfg
        self.tier = tier
        self.sessions = sessions
        self.engine = engine
        self.metrics = metrics
        self.send = send
        self.counts: Counter[str] = Counter()  # hits/misses for `kvtierd stats`
        self.started_at = time.time()
        self.metrics_address: str = ""

    # -- session ---------------------------------------------------------------------------------
    def hello(self, identity: bytes, header: dict, frames: list) -> dict:
        if self.cfg.auth_token:
            token = header.get("token")
            if not isinstance(token, str) or not hmac.compare_digest(
                token.encode("utf-8", "surrogatepass"), self.cfg.auth_token.encode("utf-8")
            ):
                raise ProtocolError(Status.AUTH_FAILED, "HELLO token missing or wrong")
        namespace = requests.field(header, "namespace", str, "a non-empty string")
        if not 0 < len(namespace) <= 256:
            raise ProtocolError(Status.BAD_REQUEST, "namespace must have 1..256 characters")
        rank = requests.field(header, "rank", int, "an int >= 0")
        if rank < 0:
            raise ProtocolError(Status.BAD_REQUEST, f"rank {rank} must be >= 0")
        fingerprint = requests.field(header, "fingerprint", str, "the layout fingerprint")
        if not 0 < len(fingerprint) <= 128:
            raise ProtocolError(Status.BAD_REQUEST, "fingerprint must have 1..128 characters")
        staging_spec = requests.field(header, "staging", dict, "a staging handle map")
        staging = self._open_staging(staging_spec)
        client = header.get("client") if isinstance(header.get("client"), dict) else {}
        session = Session(identity, namespace, rank, fingerprint, staging, client)
        self.sessions.add(session)
        self.metrics.sessions.set(len(self.sessions))
        log.info(
            "session %d: namespace %s rank %d staging %s pid %s", session.id, namespace, rank,
            staging.name if staging else "inline", client.get("pid"),
        )
        return {
            "session": session.id,
            "page_bytes": self.cfg.page_bytes,
            "daemon": __version__,
            "limits": self.limits(),
        }

    def limits(self) -> dict[str, int]:
        return {
            "protocol": PROTOCOL_VERSION,
            "max_batch": self.cfg.max_batch,
            "max_key_bytes": MAX_KEY_BYTES,
            "max_header_bytes": self.cfg.max_header_bytes,
            "max_inline_bytes": self.cfg.max_inline_bytes,
            "max_frame_bytes": self.cfg.max_frame_bytes,
            "max_staging_bytes": self.cfg.max_staging_bytes,
        }

    def _open_staging(self, spec: dict) -> ShmStaging | None:
        kind = spec.get("kind")
        if kind == "inline":
            return None
        if kind == "shm":
            return ShmStaging(spec.get("name"), spec.get("nbytes"), self.cfg.max_staging_bytes)
        if kind == "cuda_ipc":
            raise ProtocolError(
                Status.BAD_HANDLE,
                "staging kind 'cuda_ipc' needs a daemon built with CUDA; this one has no CUDA "
                "support: use 'shm' staging",
            )
        raise ProtocolError(
            Status.BAD_HANDLE, f"staging kind {kind!r} is unknown; allowed: shm, inline"
        )

    def bye(self, session: Session, header: dict, frames: list) -> dict:
        self.sessions.close(session, "bye")
        self.metrics.sessions.set(len(self.sessions))
        self.metrics.sessions_closed.labels("bye").inc()
        return {}

    def ping(self, session: Session | None, header: dict, frames: list) -> dict:
        return {}

    # -- index -----------------------------------------------------------------------------------
    def lookup(self, session: Session, header: dict, frames: list) -> dict:
        keys = requests.batch(header, "keys", self.cfg.max_batch)
        lease = bool(header.get("lease", False))
        tiers = []
        for key in keys:
            problem = requests.key_problem(key)
            if problem is not None:
                raise ProtocolError(problem[0], problem[1])
            status, entry = self.tier.lookup(session.ikey(key), session.fingerprint)
            if entry is None:
                self._miss(status)
                tiers.append(int(Tier.NONE))
                continue
            self._hit("lookup")
            if lease:
                self.sessions.lease(session, entry)
            tiers.append(int(Tier.CPU))
        return {"tiers": tiers}

    def delete(self, session: Session, header: dict, frames: list) -> dict:
        keys = requests.batch(header, "keys", self.cfg.max_batch)
        results = []
        for key in keys:
            problem = requests.key_problem(key)
            if problem is not None:
                results.append(int(problem[0]))
                continue
            ikey = session.ikey(key)
            entry = self.tier.index.get(ikey)
            if entry is not None and entry.fingerprint != session.fingerprint:
                results.append(int(Status.LAYOUT_MISMATCH))
                continue
            self.sessions.release_lease(session, ikey)
            results.append(int(self.tier.delete(ikey)))
        return {"results": results}

    def stats(self, session: Session | None, header: dict, frames: list) -> dict:
        return {
            "stats": {
                "daemon": {
                    "version": __version__,
                    "protocol": PROTOCOL_VERSION,
                    "pid": os.getpid(),
                    "uptime_s": round(time.time() - self.started_at, 3),
                    "socket": self.cfg.socket,
                    "metrics": self.metrics_address,
                    "page_bytes": self.cfg.page_bytes,
                },
                "tiers": {self.tier.name: self.tier.stats()},
                "sessions": len(self.sessions),
                "counts": dict(self.counts),
            }
        }

    def check(self, session: Session | None, header: dict, frames: list) -> dict:
        """Verify tier and session invariants; O(chunks), so an admin/test op, not a hot one."""
        try:
            self.tier.check_invariants()
            self.sessions.check_invariants()
        except AssertionError as exc:
            log.error("invariant violated: %s", exc)
            raise ProtocolError(Status.INTERNAL, f"invariant violated: {exc}") from None
        return {"checked": {"chunks": len(self.tier.index), "sessions": len(self.sessions)}}

    def _hit(self, op: str) -> None:
        self.counts[f"{op}_hits"] += 1
        self.metrics.hits.labels("cpu").inc()

    def _miss(self, status: Status, op: str = "lookup") -> None:
        self.counts[f"{op}_misses"] += 1
        self.metrics.misses.labels(status.name.lower()).inc()

    # -- data ------------------------------------------------------------------------------------
    def put(self, session: Session, header: dict, frames: list) -> dict | None:
        items = requests.items(header, self.cfg.max_batch)
        batch = self._batch(session, Op.PUT, header)
        self._check_frames(session, items, frames)
        jobs: list[tuple[int, ChunkEntry, Any]] = []
        for i, (key, offset, nbytes) in enumerate(items):
            problem = self._item_problem(session, key, offset, nbytes, frames, i)
            if problem is not None:
                self._fail(batch, i, *problem)
                continue
            status, entry = self.tier.reserve(session.ikey(key), session.fingerprint, nbytes,
                                              session.id)
            if entry is None:
                self._fail(batch, i, status, self._reserve_message(status, key, nbytes))
                continue
            session.pending.add(entry)
            batch.entries.append((i, entry))
            jobs.append((i, entry, frames[i] if session.staging is None else offset))
        self._submit(batch, jobs, self._put_job)
        return self._reply_if_done(batch)

    def get(self, session: Session, header: dict, frames: list) -> dict | None:
        items = requests.items(header, self.cfg.max_batch)
        batch = self._batch(session, Op.GET, header)
        inline = session.staging is None
        if not inline:
            session.staging.check_size()
        if inline:
            batch.out_frames = [b""] * len(items)
        jobs: list[tuple[int, ChunkEntry, Any]] = []
        for i, (key, offset, nbytes) in enumerate(items):
            problem = self._item_problem(session, key, offset, nbytes, None, i)
            if problem is not None:
                self._fail(batch, i, *problem)
                continue
            ikey = session.ikey(key)
            status, entry = self.tier.lookup(ikey, session.fingerprint)
            if entry is not None and entry.nbytes != nbytes:
                status, entry = Status.SIZE_MISMATCH, None
            self.sessions.release_lease(session, ikey)  # a GET consumes the lease
            if entry is None:
                self._miss(status, "get")
                batch.results[i] = int(status)
                continue
            self._hit("get")
            self.tier.acquire(entry)
            batch.entries.append((i, entry))
            if inline:
                batch.out_frames[i] = bytearray(nbytes)
                target: Any = batch.out_frames[i]
            else:
                target = offset
            jobs.append((i, entry, target))
        self._submit(batch, jobs, self._get_job)
        done = self._reply_if_done(batch)
        return None if done is None else (done, batch.out_frames)

    def _batch(self, session: Session, op: Op, header: dict) -> Batch:
        count = len(header["items"])
        return Batch(session, op, header.get("id"), time.perf_counter(), [0] * count, [])

    def _check_frames(self, session: Session, items: list, frames: list) -> None:
        if session.staging is not None:
            session.staging.check_size()
        elif len(frames) != len(items):
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
        if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes <= 0:
            return Status.BAD_REQUEST, f"nbytes {nbytes!r:.40} must be a positive int"
        if session.staging is not None:
            why = session.staging.check_range(offset, nbytes)
            return (Status.OUT_OF_BOUNDS, why) if why else None
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

    def _reserve_message(self, status: Status, key: bytes, nbytes: int) -> str:
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

    # -- copies ----------------------------------------------------------------------------------
    def _submit(self, batch: Batch, jobs: list, job_fn: Callable) -> None:
        """Split ``jobs`` into at most ``copy_threads`` byte-balanced parts and run them."""
        if not jobs:
            return
        parts = min(self.cfg.copy_threads, len(jobs))
        buckets: list[list] = [[] for _ in range(parts)]
        loads = [0] * parts
        for job in sorted(jobs, key=lambda j: -j[1].nbytes):
            k = loads.index(min(loads))
            buckets[k].append(job)
            loads[k] += job[1].nbytes
        batch.jobs_left = parts
        batch.session.in_flight += parts
        for bucket, nbytes in zip(buckets, loads):
            done = self.engine.submit(nbytes, lambda b=bucket: job_fn(batch.session, b), (batch, bucket))
            if done is not None:
                self.on_copy_done(*done)
        batch.deferred = batch.jobs_left > 0

    def _put_job(self, session: Session, bucket: list) -> list[bytes]:
        arena = self.tier.arena
        sums = []
        for _, entry, source in bucket:
            segs = self.tier.segments(entry)
            if session.staging is None:
                sums.append(_copy_frame_in(memoryview(source), arena, segs))
            else:
                sums.append(
                    memcpy.copy_in(session.staging.address, source, arena.address, segs,
                                   arena.view)
                )
        return sums

    def _get_job(self, session: Session, bucket: list) -> None:
        arena = self.tier.arena
        for _, entry, target in bucket:
            segs = self.tier.segments(entry)
            if session.staging is None:
                _copy_out_to_frame(arena, segs, target)
            else:
                memcpy.copy_out(arena.address, segs, session.staging.address, target)

    def on_copy_done(self, context: tuple[Batch, list], result: Any, error: BaseException | None):
        batch, bucket = context
        session = batch.session
        if error is not None:
            log.error("copy for %s batch of session %d failed", batch.op.name, session.id,
                      exc_info=error)
            for index, _, _ in bucket:
                batch.failed.add(index)
        for pos, (index, entry, _) in enumerate(bucket):
            if batch.op is Op.PUT:
                self._finish_put_item(batch, index, entry, None if error else result[pos])
            else:
                self._finish_get_item(batch, index, entry)
        batch.jobs_left -= 1
        session.in_flight -= 1
        self.sessions.release_staging(session)
        if batch.jobs_left == 0 and batch.deferred:
            # Answered even if the session ended meanwhile (BYE right behind a PUT): its peer may
            # still be there, and every request gets a reply.
            self.finish(batch, self._reply_if_done(batch))

    def _finish_put_item(self, batch: Batch, index: int, entry: ChunkEntry, digest) -> None:
        batch.session.pending.discard(entry)
        if digest is None or batch.session.closed:
            self.tier.abort(entry)
            if digest is None:
                self._fail(batch, index, Status.INTERNAL, "copy into the CPU tier failed")
            else:
                self._fail(batch, index, Status.NO_SESSION,
                           "the session ended before the copy completed; not stored")
            return
        self.tier.commit(entry, digest)
        self.metrics.bytes.labels("in", "cpu").inc(entry.nbytes)

    def _finish_get_item(self, batch: Batch, index: int, entry: ChunkEntry) -> None:
        self.tier.release(entry)
        if index in batch.failed:
            self._fail(batch, index, Status.INTERNAL, "copy out of the CPU tier failed")
            if batch.out_frames:
                batch.out_frames[index] = b""
            return
        self.metrics.bytes.labels("out", "cpu").inc(entry.nbytes)

    def _reply_if_done(self, batch: Batch) -> dict | None:
        if batch.jobs_left:
            return None
        if batch.op is Op.PUT:
            self.tier.enforce_watermarks()
        return {"results": batch.results, "errors": batch.errors}

    def finish(self, batch: Batch, fields: dict) -> None:
        """Send the reply of a batch whose copies completed after its handler returned."""
        header = reply(batch.request_id, Status.OK, **fields)
        self.send(batch.session.identity, header, batch.out_frames)
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
