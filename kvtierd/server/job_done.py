"""What a PUT or GET copy job's completion does to its chunks, on the loop thread (``DataOps``
mixes it in; ``on_copy_done`` calls it, then answers the batch if it is done).

PUT: the job's entries are committed in one call (with their checksums), announced, kept for the
ghosts (fed once per batch, when its reply is built: ``DataOps._reply_if_done``) and published
below; a failed copy, or a session that ended meanwhile, aborts each item.
GET: the job's reads are released (by slot, or entry by entry where a chunk needed its first-read
check or the chain counts reads for its admission filter); a chunk that failed its check is dropped
and counted as an integrity failure, never served.
"""

from __future__ import annotations

import logging
from operator import attrgetter, itemgetter
from typing import Any

from kvtierd.cuda_health import CudaContextLost
from kvtierd.protocol import Status
from kvtierd.server.batch import Batch, SlotReads, SlotWrites
from kvtierd.server.chain import ChainEvents
from kvtierd.tiers.chunk import ChunkEntry

log = logging.getLogger(__name__)


class JobCompletions:
    """The completion half of ``DataOps``; it uses DataOps' ``tier``, ``mover``, ``events``,
    ``metrics``, ``_bytes_in``/``_bytes_out`` and ``_feed_ghosts``."""

    def _plain_commits(self) -> bool:
        """Whether nothing uses a PUT's chunks after their commit: no kv-events (the chain's
        per-chunk hooks are then its no-op ``ChainEvents``) and no tier below that is written at
        commit (write-through NVMe, an on-commit remote without an admission filter; a write-back
        tier takes chunks when they are evicted, whatever their form). Their entries then go back
        to compact form at once, or are never built (``SlotWrites``)."""
        return (not self.events.enabled and type(self.mover.events) is ChainEvents
                and not self.mover.publishes_at_commit)

    def _put_job_done(self, batch: Batch, job: list | SlotWrites, digests: Any,
                      error: BaseException | None) -> None:
        session = batch.session
        if type(job) is SlotWrites:
            self._put_slots_done(batch, job, digests, error)
            return
        if error is not None or session.closed:
            for index, entry, _ in job:
                self._put_item_failed(batch, index, entry, error)
            return
        entries = list(map(itemgetter(1), job))
        self.tier.commit_many(entries, digests, fold=self._plain_commits())
        if self.events.enabled:
            events, blocks = self.events, batch.blocks
            for index, entry, _ in job:
                events.stored(entry.ikey, "cpu", blocks[index] if blocks else None)
        sizes = list(map(attrgetter("nbytes"), entries))
        batch.ghost_keys.extend([entry.ikey[1] for entry in entries])
        batch.ghost_nbytes.extend(sizes)
        self._bytes_in.inc(sum(sizes))
        # Publishing below and the chain's events, per chunk; neither exists without a tier
        # written at commit and with kv-events off (``_plain_commits``).
        if not self._plain_commits():
            after_commit = self.mover.after_commit
            for entry in entries:
                after_commit(entry)

    def _put_slots_done(self, batch: Batch, job: SlotWrites, digests: Any,
                        error: BaseException | None) -> None:
        """A job of reservations held by slot: committed by slot (nothing wants their entries:
        ``_plain_commits`` held when they were reserved, and kv-events and lower tiers are only
        set up at start), or aborted with each item failed."""
        session = batch.session
        if error is not None or session.closed:
            self.tier.abort_slots(job.slots)
            for index in job.items:
                self._put_failure(batch, index, error)
            return
        self.tier.commit_slots(session.space, session.fingerprint, job.keys, job.slots, digests,
                               job.nbytes)
        batch.ghost_keys.extend(job.keys)
        batch.ghost_nbytes.extend(job.sizes)
        self._bytes_in.inc(job.total)

    def _put_item_failed(self, batch: Batch, index: int, entry: ChunkEntry,
                         error: BaseException | None) -> None:
        self.tier.abort(entry)
        self._put_failure(batch, index, error)

    @staticmethod
    def _put_failure(batch: Batch, index: int, error: BaseException | None) -> None:
        """Item ``index``'s answer once its reservation is aborted."""
        if isinstance(error, CudaContextLost):
            batch.fail(index, Status.SHUTTING_DOWN, str(error))
        elif error is not None:
            batch.fail(index, Status.INTERNAL, "copy into the CPU tier failed")
        else:
            batch.fail(index, Status.NO_SESSION,
                       "the session ended before the copy completed; not stored")

    def _get_job_done(self, batch: Batch, job: list | SlotReads, corrupt: Any,
                      error: BaseException | None) -> None:
        if type(job) is SlotReads:
            self.tier.release_slots(job.slots, job.pages)
            if error is None:
                self._bytes_out.inc(job.nbytes)
            else:
                for index in job.items:
                    self._get_item_failed(batch, index, None, error)
            return
        if error is None and not corrupt and not self.mover.counts_reads:  # all served
            self._bytes_out.inc(self.tier.release_read(list(map(itemgetter(1), job))))
            return
        release, after_read = self.tier.release, self.mover.after_read
        served = 0
        for pos, (index, entry, _) in enumerate(job):
            release(entry)
            if error is None and not (corrupt and pos in corrupt):
                entry.verified = True
                served += entry.nbytes
                after_read(entry)  # the chain's admission filter counts reads
            else:
                self._get_item_failed(batch, index, entry, error)
        self._bytes_out.inc(served)

    def _get_item_failed(self, batch: Batch, index: int, entry: ChunkEntry | None,
                         error: BaseException | None) -> None:
        """``entry`` None: a read held by slot, whose copy failed (never a check)."""
        if batch.out_frames:
            batch.out_frames[index] = b""
        if error is None and entry is not None:  # the chunk failed its first-read check
            self.metrics.integrity_failures.labels("cpu").inc()
            log.error("chunk %r failed its checksum after a warm restart; dropped", entry.ikey)
            self.mover.drop_cpu(entry)
            batch.fail(index, Status.CHECKSUM_MISMATCH, "stored bytes failed their check")
        elif isinstance(error, CudaContextLost):
            batch.fail(index, Status.SHUTTING_DOWN, str(error))
        else:
            batch.fail(index, Status.INTERNAL, "copy out of the CPU tier failed")
