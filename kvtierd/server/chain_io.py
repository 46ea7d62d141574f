"""Completions of the tier chain's I/O jobs, on the loop thread (``TierChain.on_io_done``).

One function per job kind; each settles the bookkeeping of both tiers involved, counts what
happened (metrics with the ``tier`` label) and says why in the log when something failed. The
classification of a failure is the same for every tier: ``IntegrityError`` (the copy is wrong: drop
it, count an integrity failure), ``TierUnavailable`` (the tier is unreachable: keep the copy, open
the circuit) or any other error (the copy is unusable: drop it, count an I/O failure by errno).
"""

from __future__ import annotations

import errno
import logging
import time
from typing import TYPE_CHECKING, Any

from kvtierd.tiers.lower import IntegrityError, TierUnavailable

if TYPE_CHECKING:
    from kvtierd.server.chain import IoJob, Promotion, TierChain

log = logging.getLogger(__name__)


def complete(chain: TierChain, job: IoJob, result: Any, error: BaseException | None) -> None:
    elapsed = time.perf_counter() - job.started
    chain.metrics.tier_io_latency.labels(job.link.name, job.kind).observe(elapsed)
    if job.link.name == "nvme":  # the NVMe-only histogram dashboards already use
        chain.metrics.io_latency.labels(job.kind).observe(elapsed)
    if isinstance(error, TierUnavailable):
        chain.trip(job.link, error)
    _DONE[job.kind](chain, job, result, error)


def _demote_done(chain: TierChain, job: IoJob, result: Any, error: BaseException | None) -> None:
    assert job.writes is not None
    _writes_done(chain, job, error, "demotion")
    cpu = chain.cpu
    for entry, _ in job.writes:
        cpu.unmark_demoting(entry)
        cpu.release(entry)
        leaving = cpu.index.get(entry.ikey) is entry
        cpu.finish_demotion(entry)
        if leaving:
            chain.events.dropped(cpu.name, entry)
            if error is not None:  # its write below failed: no tier holds it now
                chain.metrics.evictions_dropped.labels(cpu.name, "write_failed").inc()
        if error is None:
            chain.metrics.demotions.inc()
            chain.metrics.bytes.labels("demote", job.link.name).inc(entry.nbytes)
    chain.on_space()
    next_round(chain)


def next_round(chain: TierChain) -> None:
    """Start the arena's next demotion round now if the parked PUTs (``on_space``) left it
    with less than a round free, and what is free or on its way out is less than the two rounds
    ``CpuTier._make_room`` keeps coming.

    Without this the next round starts only when a later reservation finds the arena full
    (``CpuTier._make_room``): after the client's round trip and the copies of the PUT that took
    these pages. Both rounds in flight then tend to start, write, fdatasync and commit their
    index rows together, and the disk idles while they sync (measured, 2 MiB chunks, 512 MiB
    arena: rounds started in pairs ~55 ms apart, 15-20% of the demotion time with nothing at
    the disk). Started here, a round's writes queue behind the other round's and keep the disk
    busy while that one syncs. An arena that keeps a round free (nobody writing) demotes no
    further, and one part of the rounds finishing before the rest (another tier's job) leaves
    free + demoting as it was: no extra round either."""
    cpu = chain.cpu
    free = cpu.allocator.free_pages
    if (cpu.demoter is not None and free < cpu.round_pages
            and free + cpu.demoting_pages < 2 * cpu.round_pages):
        cpu.evict(cpu.round_pages)


def _write_through_done(chain: TierChain, job: IoJob, result: Any,
                        error: BaseException | None) -> None:
    assert job.writes is not None
    _writes_done(chain, job, error, "on-commit write")
    for entry, _ in job.writes:
        chain.cpu.release(entry)
        if error is None:
            chain.metrics.bytes.labels("write_through", job.link.name).inc(entry.nbytes)


def _writes_done(chain: TierChain, job: IoJob, error: BaseException | None, what: str) -> None:
    assert job.writes is not None
    tier = job.link.tier
    for cpu_entry, target in job.writes:
        if error is not None:
            tier.abort(target)
            continue
        tier.commit(target)
        if cpu_entry.doomed:  # DELETEd while being written: its copy below must go too
            tier.drop(target)
        else:
            chain.events.stored(tier.name, target)
    if error is not None:
        chain.metrics.io_failures.labels(tier.name, reason(error)).inc()
        log.error("%s %s of %d chunk(s) failed (%s); they are not stored there", tier.name, what,
                  len(job.writes), error)


def _promote_done(chain: TierChain, job: IoJob, result: Any, error: BaseException | None) -> None:
    """Settle each promotion of the job on its own: the job's error (it raised as a whole) or
    the item's entry in the result (``LowerTier.read_batch_job``)."""
    assert job.reads is not None
    if error is None and (not isinstance(result, list) or len(result) != len(job.reads)):
        # a tier's bug: every item fails (and is answered) rather than waiting forever
        error = RuntimeError(f"the {job.link.name} read job answered {result!r:.80} for "
                             f"{len(job.reads)} items")
    outcomes = [error] * len(job.reads) if error is not None else result
    if error is None:  # an item's TierUnavailable opens the circuit as a job's does
        down = next((o for o in outcomes if isinstance(o, TierUnavailable)), None)
        if down is not None:
            chain.trip(job.link, down)
    for read, outcome in zip(job.reads, outcomes):
        _promoted(chain, job, read, outcome)


def _promoted(chain: TierChain, job: IoJob, read: Promotion, outcome: Any) -> None:
    tier, source, target = job.link.tier, read.source, read.target
    tier.release(source)
    if not isinstance(outcome, BaseException) and source.doomed:
        # DELETEd while being read: the reader gets a miss
        chain.cpu.abort(target)
        read.done(False, f"the {tier.name} copy was deleted while it was read")
        return
    if isinstance(outcome, BaseException):
        chain.cpu.abort(target)
        if isinstance(outcome, IntegrityError):
            chain.metrics.integrity_failures.labels(tier.name).inc()
            log.error("%s; chunk dropped from the %s tier, the reader gets a miss", outcome,
                      tier.name)
        elif not isinstance(outcome, TierUnavailable):
            chain.metrics.io_failures.labels(tier.name, reason(outcome)).inc()
            log.error("%s read of chunk %r failed (%s); chunk dropped", tier.name, source.ikey,
                      outcome)
        if not isinstance(outcome, TierUnavailable) and tier.peek(source.ikey) is source:
            tier.drop(source)
        read.done(False, f"the {tier.name} copy failed its check or could not be read")
        return
    chain.cpu.commit(target, outcome)
    chain.events.stored(chain.cpu.name, target)
    chain.metrics.promotions.inc()
    chain.metrics.bytes.labels("promote", tier.name).inc(target.nbytes)
    read.done(True, "")


def _cascade_done(chain: TierChain, job: IoJob, result: Any, error: BaseException | None) -> None:
    """Chunks evicted above, read into arena pages and written to ``job.link``'s tier: each one
    committed there or its reservation aborted; the arena pages and the evicted copy let go."""
    assert job.cascades is not None
    link = job.link
    if error is not None and not isinstance(error, TierUnavailable):
        chain.metrics.io_failures.labels(link.name, reason(error)).inc()
        log.error("%s write of %d chunks evicted from the tier above failed (%s); dropped",
                  link.name, len(job.cascades), error)
    elif isinstance(error, TierUnavailable):
        chain.trip(link, error)
    outcomes = result if error is None else [error] * len(job.cascades)
    for c, outcome in zip(job.cascades, outcomes):
        if outcome is None:
            link.tier.commit(c.target)
            chain.events.stored(link.name, c.target)
            chain.metrics.bytes.labels("cascade", link.name).inc(c.target.nbytes)
        else:
            link.tier.abort(c.target)
            if error is None:  # this chunk's read failed: the copy above is gone anyway
                chain.metrics.io_failures.labels(c.source_link.name, reason(outcome)).inc()
            chain.metrics.evictions_dropped.labels(
                c.source_link.name, "read_failed" if error is None else "write_failed").inc()
        chain.bounce.give_back(c.bounce)
        c.source_link.tier.release(c.source)  # doomed: its pages come back via a delete job


def _delete_done(chain: TierChain, job: IoJob, result: Any, error: BaseException | None) -> None:
    assert job.deleted is not None
    tier = job.link.tier
    if error is not None:
        # The rows may still name these pages after a crash; keeping the pages out of use is
        # the safe side (checksums would catch a reuse, but we do not rely on that).
        chain.metrics.io_failures.labels(tier.name, reason(error)).inc()
        log.error("deleting %d %s chunks failed (%s); their space stays reserved until restart",
                  len(job.deleted), tier.name, error)
        return
    tier.deleted(job.deleted)


def _exists_done(chain: TierChain, job: IoJob, result: Any, error: BaseException | None) -> None:
    assert job.keys is not None and job.done is not None
    chain.checks_in_flight -= 1
    if error is not None and not isinstance(error, TierUnavailable):
        chain.metrics.io_failures.labels(job.link.name, reason(error)).inc()
        log.error("%s existence check of %d keys failed (%s); they count as misses",
                  job.link.name, len(job.keys), error)
    job.link.tier.exists_done(job.keys, job.fingerprint, None if error is not None else result)
    job.done()


def _probe_done(chain: TierChain, job: IoJob, result: Any, error: BaseException | None) -> None:
    if error is not None and not isinstance(error, TierUnavailable):
        log.warning("%s tier probe failed (%s); it stays skipped", job.link.name, error)
    chain.probed(job.link, error)


def reason(error: BaseException) -> str:
    """The ``reason`` label of an I/O failure: the errno's name, ``unavailable`` or ``other``."""
    if isinstance(error, TierUnavailable):
        return "unavailable"
    code = getattr(error, "errno", None)
    return errno.errorcode.get(code, "other").lower() if code else "other"


_DONE = {"demote": _demote_done, "write_through": _write_through_done,
         "promote": _promote_done, "cascade": _cascade_done, "delete": _delete_done,
         "exists": _exists_done, "probe": _probe_done}
