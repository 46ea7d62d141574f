"""Moving chunks between the CPU and NVMe tiers: demotion, write-through, promotion reads, deletes.

Runs on the loop thread and hands every byte transfer to the I/O engine (its own thread pool, so a
slow disk never stalls the request loop or the memcpy threads). Rules:

* **Demotion (write-back, the default)**: the CPU tier picks a victim and asks ``demote``; the chunk
  stays READY and readable in the arena, marked ``demoting`` (not evictable, one ref held by the
  write), until its NVMe copy and index row are durable; then it leaves the arena. A chunk whose
  NVMe copy already exists (``on_nvme``) is dropped from the arena at once.
* **Write-through**: every commit also starts an NVMe write; the arena copy stays and becomes
  ``on_nvme`` (free to drop) once durable.
* **Faults**: a failed NVMe write drops that chunk from the NVMe tier (and, for a demotion, from
  the arena, which it was leaving anyway); a failed or corrupt read drops the NVMe copy and the
  reader gets a miss. Each raises a metric and a log line; the daemon keeps serving.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from kvtierd.copy.engine import CopyEngine
from kvtierd.events import NO_EVENTS, NoEvents
from kvtierd.metrics import DaemonMetrics
from kvtierd.protocol import Status, Tier
from kvtierd.tiers.chunk import ChunkEntry
from kvtierd.tiers.cpu import CpuTier
from kvtierd.tiers.nvme import IntegrityError, NvmeTier

log = logging.getLogger(__name__)


#: Writes queued during one loop iteration are flushed as jobs of about this many bytes, so that
#: many small chunks share one fdatasync and one index transaction.
WRITE_JOB_BYTES = 32 * 1024**2


@dataclass(eq=False)
class IoJob:
    kind: str  # "demote" | "write_through" | "promote" | "delete"
    cpu_entry: ChunkEntry | None = None  # promote: the arena target
    nvme_entry: ChunkEntry | None = None  # promote: the NVMe source
    writes: list[tuple[ChunkEntry, ChunkEntry]] | None = None  # (cpu entry, nvme target)
    deleted: list[ChunkEntry] | None = None
    done: Callable[[bool], None] | None = None  # promote: the waiting GET batch
    started: float = field(default_factory=time.perf_counter)


class TierMover:
    def __init__(self, cpu: CpuTier, nvme: NvmeTier | None, engine: CopyEngine,
                 metrics: DaemonMetrics, write_through: bool) -> None:
        self.cpu = cpu
        self.nvme = nvme
        self.engine = engine
        self.metrics = metrics
        self.write_through = write_through and nvme is not None
        self.on_space: Callable[[], None] = lambda: None  # set by the handlers (parked PUTs)
        self.events: NoEvents = NO_EVENTS  # kv-events hook: set by the daemon
        self._queued: dict[str, list[tuple[ChunkEntry, ChunkEntry]]] = {
            "demote": [], "write_through": []}
        if nvme is not None:
            cpu.demoter = self.demote
            nvme.on_drop = self._nvme_dropped

    # -- lookups across tiers ----------------------------------------------------------------------
    def lookup(self, ikey: Any, fingerprint: str) -> tuple[Status, Tier, ChunkEntry | None]:
        status, entry = self.cpu.lookup(ikey, fingerprint)
        if entry is not None or self.nvme is None or status is Status.LAYOUT_MISMATCH:
            return status, Tier.CPU, entry
        status, entry = self.nvme.lookup(ikey, fingerprint)
        return status, Tier.NVME, entry

    def tier_stats(self) -> list[tuple[str, dict[str, int]]]:
        tiers = [(self.cpu.name, self.cpu.stats())]
        if self.nvme is not None:
            tiers.append((self.nvme.name, self.nvme.stats()))
        return tiers

    def space_coming(self) -> bool:
        """Whether arena pages may free up without anyone asking: demotions in flight, PENDING
        chunks (their commit makes them evictable; their abort frees them), or chunks held by
        copies in flight (evictable once released)."""
        return (self.cpu.demoting_pages > 0 or self.cpu.pending_pages > 0
                or self.cpu.held_pages > 0)

    # -- writes ------------------------------------------------------------------------------------
    def demote(self, entry: ChunkEntry) -> bool:
        """Start writing a CPU victim to NVMe; False means "drop it now" (clean or no room)."""
        assert self.nvme is not None
        if entry.on_nvme:
            return False
        target = self.nvme.reserve(entry.ikey, entry.fingerprint, entry.nbytes, entry.checksum)
        if target is None:
            self.metrics.io_failures.labels("nvme", "no_space").inc()
            return False
        self.cpu.mark_demoting(entry)
        self.cpu.acquire(entry)
        self._queued["demote"].append((entry, target))
        return True

    def after_commit(self, entry: ChunkEntry) -> None:
        if not self.write_through:
            return
        assert self.nvme is not None
        target = self.nvme.reserve(entry.ikey, entry.fingerprint, entry.nbytes, entry.checksum)
        if target is None:
            return
        self.cpu.acquire(entry)
        self._queued["write_through"].append((entry, target))

    def promote(self, source: ChunkEntry, target: ChunkEntry, done: Callable[[bool], None]) -> None:
        """Read an NVMe chunk into reserved arena pages (``target``, PENDING), then ``done(ok)``."""
        assert self.nvme is not None
        self.nvme.acquire(source)
        job = self.nvme.read_job(source, self.cpu.arena, target.runs, self.cpu.segments(target))
        self._submit(IoJob("promote", target, source, done=done), job, source.nbytes)

    def delete(self, ikey: Any) -> Status:
        status = self.cpu.delete(ikey)
        if self.nvme is not None:
            nvme_status = self.nvme.delete(ikey)
            if status is Status.MISS:
                status = nvme_status
        self.flush_deletions()
        return status

    def flush(self) -> None:
        """Submit the writes and deletes queued during this loop iteration (called by the loop)."""
        if self.nvme is None:
            return
        for kind, queued in self._queued.items():
            if not queued:
                continue
            self._queued[kind] = []
            # Spread over the I/O threads, but never below WRITE_JOB_BYTES per fdatasync.
            per_job = max(WRITE_JOB_BYTES, -(-sum(c.nbytes for c, _ in queued)
                                             // self.engine.threads))
            batch: list[tuple[ChunkEntry, ChunkEntry]] = []
            size = 0
            for pair in queued:
                batch.append(pair)
                size += pair[0].nbytes
                if size >= per_job:
                    self._submit_writes(kind, batch, size)
                    batch, size = [], 0
            if batch:
                self._submit_writes(kind, batch, size)
        self.flush_deletions()

    def _submit_writes(self, kind: str, batch: list[tuple[ChunkEntry, ChunkEntry]], size: int
                       ) -> None:
        assert self.nvme is not None
        items = [(target, cpu_entry.runs) for cpu_entry, target in batch]
        self._submit(IoJob(kind, writes=batch), self.nvme.write_job(items, self.cpu.arena), size)

    def flush_deletions(self) -> None:
        if self.nvme is None:
            return
        entries = self.nvme.take_deletions()
        if entries:
            self._submit(IoJob("delete", deleted=entries), self.nvme.delete_job(entries), 0)

    def _submit(self, job: IoJob, fn: Callable[[], Any], nbytes: int) -> None:
        done = self.engine.submit(nbytes, fn, job)
        assert done is None, "the I/O engine never runs jobs inline"

    # -- completions -------------------------------------------------------------------------------
    def on_io_done(self, job: IoJob, result: Any, error: BaseException | None) -> None:
        self.metrics.io_latency.labels(job.kind).observe(time.perf_counter() - job.started)
        handler = getattr(self, f"_{job.kind}_done")
        handler(job, result, error)
        self.flush()

    def _demote_done(self, job: IoJob, result: Any, error: BaseException | None) -> None:
        assert job.writes is not None
        self._writes_done(job, error, "demotion")
        for entry, target in job.writes:
            self.cpu.unmark_demoting(entry)
            self.cpu.release(entry)
            self.cpu.finish_demotion(entry)
            if error is None:
                self.metrics.demotions.inc()
                self.metrics.bytes.labels("demote", "nvme").inc(entry.nbytes)
        self.on_space()

    def _write_through_done(self, job: IoJob, result: Any, error: BaseException | None) -> None:
        assert job.writes is not None
        self._writes_done(job, error, "write-through")
        for entry, _ in job.writes:
            self.cpu.release(entry)
            if error is None and self.cpu.index.get(entry.ikey) is entry:
                entry.on_nvme = True
                self.metrics.bytes.labels("write_through", "nvme").inc(entry.nbytes)

    def _writes_done(self, job: IoJob, error: BaseException | None, what: str) -> None:
        assert self.nvme is not None and job.writes is not None
        for cpu_entry, target in job.writes:
            if error is not None:
                self.nvme.abort(target)
                continue
            self.nvme.commit(target)
            self.events.stored(target.ikey, "nvme")  # kv-events hook
            if cpu_entry.doomed:  # DELETEd while being written: its row must go too
                self.nvme.drop(target)
        if error is not None:
            self.metrics.io_failures.labels("nvme", _errno_name(error)).inc()
            log.error("NVMe %s of %d chunk(s) failed (%s); they are dropped from the NVMe tier",
                      what, len(job.writes), error)

    def _promote_done(self, job: IoJob, result: Any, error: BaseException | None) -> None:
        assert self.nvme is not None and job.nvme_entry and job.done
        source = job.nvme_entry
        self.nvme.release(source)
        if error is not None:
            if isinstance(error, IntegrityError):
                self.metrics.integrity_failures.labels("nvme").inc()
                log.error("%s; chunk dropped, the reader gets a miss", error)
            else:
                self.metrics.io_failures.labels("nvme", _errno_name(error)).inc()
                log.error("NVMe read of chunk %r failed (%s); chunk dropped", source.ikey, error)
            if self.nvme.index.get(source.ikey) is source:
                self.nvme.drop(source)
            job.done(False)
            return
        self.metrics.promotions.inc()
        self.metrics.bytes.labels("promote", "nvme").inc(source.nbytes)
        job.done(True)

    def _delete_done(self, job: IoJob, result: Any, error: BaseException | None) -> None:
        assert self.nvme is not None and job.deleted is not None
        if error is not None:
            # The rows may still name these pages after a crash; keeping the pages out of use is
            # the safe side (checksums would catch a reuse, but we do not rely on that).
            self.metrics.io_failures.labels("nvme", _errno_name(error)).inc()
            log.error("deleting %d NVMe index rows failed (%s); their pages stay reserved until "
                      "restart", len(job.deleted), error)
            return
        self.nvme.deleted(job.deleted)

    def _nvme_dropped(self, entry: ChunkEntry) -> None:
        self.events.removed(entry.ikey, "nvme")  # kv-events hook
        cpu_entry = self.cpu.index.get(entry.ikey)
        if cpu_entry is not None:
            cpu_entry.on_nvme = False


def _errno_name(error: BaseException) -> str:
    import errno

    code = getattr(error, "errno", None)
    return errno.errorcode.get(code, "other").lower() if code else "other"
