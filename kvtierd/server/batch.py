"""One PUT or GET batch on its way through the daemon, and the copy jobs it is cut into.

A batch is answered once every item has an outcome: no job in flight, no item parked waiting for
space, and its handler done adding items (``building``). Its copies go out in jobs of a few MiB as
the items are reserved (``JobQueue``), so the copy threads start on the first chunks while the loop
still reserves the last ones, and a job's completion is one wake-up of the loop for many chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from kvtierd.protocol import Op, Status
from kvtierd.server.sessions import Session

MAX_ERRORS = 32  # per reply; results still carry every item's status
#: The largest copy job: big enough that submitting and completing it is noise next to its
#: memmoves, small enough that a 64 MiB batch is cut into enough jobs to keep every copy thread
#: busy while the loop is still reserving. Measured on 2 cores (cpu_roundtrip, alternating):
#: 8 MiB against 4 MiB took PUT of 16 KiB / 64 KiB / 2 MiB chunks from 0.60-0.82 / 0.73-0.78 /
#: 0.63x of memcpy to 0.69-0.73 / 0.78-0.89 / 0.75-0.76x (a completed job costs the loop tens of
#: µs: ~1 µs per 64 KiB item at 4 MiB); 16 MiB jobs were no better (0.66-0.68 / 0.82-0.85 /
#: 0.69-0.71x).
MAX_JOB_BYTES = 8 * 1024**2
#: The largest job after a batch's first ones (one per copy thread, of at most MAX_JOB_BYTES):
#: once every copy thread has work, what is left of the batch goes out in as few jobs as keep
#: them all busy (``job_bounds``). Each job costs the loop a submit, a wake-up and a completion
#: whatever its size: at 16 KiB, a 64 MiB batch in 4 jobs instead of 8 took about a tenth off a
#: PUT's and a GET's loop time per item, and a third at 64 KiB (cpu_per_item, alternating).
LARGE_JOB_BYTES = 4 * MAX_JOB_BYTES
#: Jobs grow past the lead ones only where a lead job holds at least this many chunks (chunks of
#: 64 KiB or less): there a job's fixed cost is a share of every item's; with fewer, larger
#: chunks the copy threads are better balanced by more jobs (GET of 2 MiB chunks in 4 jobs read
#: 1.29-1.79x of memcpy against 1.66-2.08x in 8, 3 runs alternating).
GROW_MIN_ITEMS = 128


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
    deferred: bool = False  # the handler returned before the jobs completed
    building: bool = True  # the handler is still adding items
    parked: list[tuple[int, Any, Any, Any]] = field(default_factory=list)  # items awaiting space
    frames: list = field(default_factory=list)  # inline PUT payloads
    inline_bytes: int = 0  # of the session's max_inline_reply_bytes, what this GET's reply holds
    blocks: list | None = None  # kv-events: PUT items' parsed ``blocks`` (kvtierd.event_blocks)
    # Ghost feed, applied once per batch step (kvtierd.ghost): PUT keys stored or already there,
    # with their sizes; GET keys read.
    ghost_keys: list[bytes] = field(default_factory=list)
    ghost_nbytes: list[int] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.jobs_left == 0 and not self.parked and not self.building

    def fail(self, index: int, status: Status, message: str) -> None:
        self.results[index] = int(status)
        if message and len(self.errors) < MAX_ERRORS:
            self.errors.append([index, status.name, message])


@dataclass(eq=False, slots=True)
class SlotReads:
    """A GET copy job of chunks held by slot (``CpuTier.acquire_slots``), as columns: no
    tuple and no entry per chunk. The copy thread reads ``src``/``dst``/``sizes``; the loop
    releases ``slots`` (``pages`` in all) when the job is done, and fails ``items`` if it
    failed."""

    items: list[int]  # the batch's item indices
    slots: list[int]
    src: list[int]  # arena byte offsets
    dst: list[int]  # staging byte offsets
    sizes: list[int]
    pages: int
    nbytes: int


@dataclass(eq=False, slots=True)
class SlotWrites:
    """A PUT copy job of reservations held by slot (``CpuTier.reserve_slots``), as columns: no
    entry per chunk. The copy thread reads ``src``/``dst``/``sizes`` and returns a checksum per
    chunk; the loop commits ``slots`` (``keys`` of the batch's key space, ``nbytes`` each) when
    the job is done, or aborts them and fails ``items`` if it failed."""

    items: list[int]  # the batch's item indices
    keys: list[bytes]
    slots: list[int]
    src: list[int]  # staging byte offsets
    dst: list[int]  # arena byte offsets
    nbytes: int  # per chunk (a batch is one chunk size)
    total: int  # bytes in all

    @property
    def sizes(self) -> list[int]:
        return [self.nbytes] * len(self.slots)


def job_bytes(items: list, threads: int) -> int:
    """Bytes per copy job for ``items``: the batch spread over the copy threads, at most
    MAX_JOB_BYTES. The total is estimated from the first item (batches are one chunk size)."""
    first = items[0][2] if items else 0
    estimate = len(items) * first if type(first) is int else 0
    return max(1, min(MAX_JOB_BYTES, estimate // max(1, threads)))


def job_bounds(count: int, step: int, lead: int, large: int) -> list[tuple[int, int]]:
    """The item ranges ``(first, end)`` of a batch of ``count`` items cut into copy jobs: ``lead``
    jobs (one per copy thread) of ``step`` items, so that every thread starts while the loop
    still reserves, then the rest spread over ``lead`` jobs of at least ``step`` and at most
    ``large`` items (more where that cap is reached). ``lead`` 0: every job ``step`` items."""
    step = max(1, step)
    bounds = []
    first = 0
    while first < count and (not lead or len(bounds) < lead):
        bounds.append((first, min(count, first + step)))
        first += step
    if first < count:
        per = min(max(step, large), max(step, -(-(count - first) // lead)))
        for start in range(first, count, per):
            bounds.append((start, min(count, start + per)))
    return bounds


class JobQueue:
    """Collects a batch's copy items and submits them as a job once ``target`` bytes are queued.
    ``lead``: the copy threads, for the batch primitives' own job cuts (``job_bounds``)."""

    __slots__ = ("_submit", "target", "lead", "job", "nbytes")

    def __init__(self, submit: Callable[[list, int], None], target: int, lead: int = 0) -> None:
        self._submit = submit
        self.target = target
        self.lead = lead
        self.job: list = []
        self.nbytes = 0

    def add(self, item: tuple, nbytes: int) -> None:
        self.job.append(item)
        self.nbytes += nbytes
        if self.nbytes >= self.target:
            self.flush()

    def add_many(self, items: list[tuple], nbytes: int) -> None:
        """``add`` of several items of ``nbytes`` in all (a job's worth from a batched primitive):
        submitted together once ``target`` is reached."""
        self.job.extend(items)
        self.nbytes += nbytes
        if self.nbytes >= self.target:
            self.flush()

    def flush(self) -> None:
        if self.job:
            job, nbytes = self.job, self.nbytes
            self.job, self.nbytes = [], 0
            self._submit(job, nbytes)
