"""Double-buffered PUT/GET: a call split into staging pieces, the next piece's copy overlapping
the daemon's copy of the previous one.

A store gathers piece k+1 into staging while the daemon copies piece k out of it; a load scatters
piece k while the daemon copies piece k+1 in. Both sides run at once (the daemon's copies and the
client's compiled copies release the GIL, and they are different processes), so a call takes about
the longer of the two copies instead of their sum. That holds for GPU caches; on host caches the
two copies share the memory bus, and a call is one piece when staging holds it
(``host_piece_target``).

Planning (``plan``): chunks keep their order and are laid out in staging as a ring: each piece is a
contiguous range of whole chunks (a chunk is one PUT/GET item, never split), at most ``max_items``
of them and about ``piece_bytes``; a piece that would pass the end of the buffer starts again at
offset 0. Running (``run``): before a piece's range is used, every earlier piece whose range
overlaps it has been answered and finished (``after``), and at most ``depth`` requests are in
flight (the daemon's ``max_in_flight_requests`` answers more with BUSY).

Errors: when a piece's request fails, the requests still in flight are answered first (their
replies waited for, their errors dropped) so that no daemon copy still reads or writes the staging
buffer when the error reaches the caller; a timeout there is raised as it is (the caller then
drops the session and its staging buffer, as for any timeout; nothing is waited for then, since
the session is given up as a whole).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .planner import Chunk
from .staging import align
from .transport import DaemonError, DaemonUnavailable

#: Target piece size. Each piece is one request: ~0.1 ms of round trip and daemon work on an idle
#: machine, but a send can wait several ms for a CPU on a loaded one (measured here, 2 cores at
#: load 5-7), so pieces are large enough for that to stay small, yet a 32 MiB store has four.
PIECE_BYTES = 8 * 1024**2
#: A call is cut into at least this many pieces when its chunks allow it, down to MIN_PIECE_BYTES.
MIN_PIECES = 2
MIN_PIECE_BYTES = 1024**2
#: Requests in flight per call: one being copied by the daemon, one being gathered or scattered.
DEPTH = 2


@dataclass(frozen=True)
class Piece:
    """Consecutive chunks of one call and their staging offsets; ``[start, end)`` is the range."""

    slots: tuple[tuple[Chunk, int], ...]
    start: int
    end: int


def piece_target(total_bytes: int, staging_bytes: int) -> int:
    """About ``PIECE_BYTES``, fewer bytes for small calls (so that they still overlap), and at
    most half the buffer (so that two pieces fit in it at once)."""
    want = min(PIECE_BYTES, max(MIN_PIECE_BYTES, -(-total_bytes // MIN_PIECES)))
    return max(1, min(want, staging_bytes // 2))


def host_piece_target(total_bytes: int, staging_bytes: int) -> int:
    """The CPU path's piece (KV caches in host memory): the whole call, or as much of it as the
    staging buffer holds. There the gather and the daemon's copy share one memory bus and, on a
    small node, the same cores: cutting a call in pieces costs a round trip and a batch per piece
    and has not bought overlap. Measured with ``benchmarks/client_path.py`` (32 MiB calls): in
    November, where the gather and a memcpy run at once took as long as one after the other
    (its overlap column 0.93-1.13x), load / ceiling 0.62-0.71x with 8 MiB pieces against
    0.76-0.84x with one, store 0.47-0.58x against 0.56-0.58x; on 3 December, where that column
    read 1.40-1.64x (two threads do gain on that VM), store at 256 KiB / 2 MiB / 8 MiB chunks
    0.64 / 0.76 / 0.83x with 8 MiB pieces and 0.53 / 0.64 / 0.76x with 4 MiB ones, against
    0.72 / 0.86 / 0.79x with one piece, in the same window: the client's gather and the daemon's
    two copy threads are three busy threads on two cores. A GPU gather (DMA into pinned staging)
    does overlap the daemon's copy: ``piece_target``."""
    return max(1, min(total_bytes, staging_bytes))


def plan(chunks: Sequence[Chunk], nbytes_of: Callable[[Chunk], int], staging_bytes: int,
         piece_bytes: int, max_items: int) -> list[Piece]:
    """Cut ``chunks`` (in order) into pieces laid out in staging as a ring (module docstring).
    Every chunk fits the buffer (the client checks that at construction)."""
    pieces: list[Piece] = []
    slots: list[tuple[Chunk, int]] = []
    start = offset = 0

    def close() -> None:
        nonlocal slots, start
        if slots:
            pieces.append(Piece(tuple(slots), start, offset))
            slots, start = [], offset

    for chunk in chunks:
        nbytes = nbytes_of(chunk)
        at = align(offset)
        if slots and (at + nbytes - start > piece_bytes or len(slots) >= max_items):
            close()
        if at + nbytes > staging_bytes:  # past the end: the ring starts again at 0
            close()
            start = at = 0
        if not slots:
            start = at
        slots.append((chunk, at))
        offset = at + nbytes
    close()
    return pieces


def _overlaps(a: Piece, b: Piece) -> bool:
    return a.start < b.end and b.start < a.end


def run(pieces: Sequence[Piece], depth: int, before: Callable[[Piece], None],
        send: Callable[[Piece], int], receive: Callable[[int], dict],
        after: Callable[[Piece, dict], list[bool]]) -> list[bool]:
    """Run ``pieces`` through ``before`` (e.g. gather) → ``send`` (request id) → ``receive``
    (reply header) → ``after`` (e.g. scatter; per-chunk results), keeping up to ``depth``
    requests in flight. Returns the per-chunk results in chunk order."""
    results: list[list[bool]] = [[] for _ in pieces]
    flight: deque[tuple[int, int]] = deque()  # (piece index, request id), oldest first

    def finish_oldest() -> None:
        index, request_id = flight.popleft()
        results[index] = after(pieces[index], receive(request_id))

    try:
        for index, piece in enumerate(pieces):
            while flight and (len(flight) >= depth
                              or any(_overlaps(pieces[i], piece) for i, _ in flight)):
                finish_oldest()
            before(piece)
            flight.append((index, send(piece)))
        while flight:
            finish_oldest()
    except DaemonUnavailable:
        raise  # the session is dropped with its staging buffer: nothing to wait for
    except BaseException:
        _drain(flight, receive)
        raise
    return [ok for piece_results in results for ok in piece_results]


def _drain(flight: deque[tuple[int, int]], receive: Callable[[int], Any]) -> None:
    """Wait for the replies still owed, so no daemon copy uses staging after we return."""
    while flight:
        _, request_id = flight.popleft()
        try:
            receive(request_id)
        except DaemonError:
            pass  # that piece failed too; the first error is the one raised
