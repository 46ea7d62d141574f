"""Staging pieces and the two-in-flight schedule of ``kvtier_client.pipeline``.

``run`` is driven here by a recording daemon stand-in made of plain callables (the real daemon is
in tests/integration/test_client_pipeline.py); it answers requests in a random order, as the real
one may when its copy threads finish out of order.
"""

import random

import pytest

from kvtier_client import pipeline
from kvtier_client.planner import Chunk
from kvtier_client.staging import ALIGN
from kvtier_client.transport import DaemonError, DaemonUnavailable
from kvtierd.protocol import Op, Status


def chunks(sizes):
    return [Chunk(key=b"k%d" % i, group=0, block_ids=(i,), token_start=0, token_end=16,
                  nbytes=n) for i, n in enumerate(sizes)]


def plan(sizes, staging, piece, max_items=1024):
    return pipeline.plan(chunks(sizes), lambda c: c.nbytes, staging, piece, max_items)


@pytest.mark.parametrize("seed", range(8))
def test_pieces_keep_order_fit_the_buffer_and_respect_their_limits(seed):
    rng = random.Random(seed)
    sizes = [rng.randrange(1, 5000) for _ in range(rng.randrange(1, 60))]
    staging = max(sizes) + ALIGN + rng.randrange(0, 20000)
    piece_bytes, max_items = rng.randrange(1, 12000), rng.randrange(1, 8)
    pieces = plan(sizes, staging, piece_bytes, max_items)
    slots = [s for p in pieces for s in p.slots]
    assert [c.nbytes for c, _ in slots] == sizes  # every chunk once, in order
    for p in pieces:
        assert 1 <= len(p.slots) <= max_items
        assert len(p.slots) == 1 or p.end - p.start <= piece_bytes
        ends = [off + c.nbytes for c, off in p.slots]
        assert p.start == p.slots[0][1] and p.end == ends[-1] <= staging
        for (c, off), prev_end in zip(p.slots[1:], ends):
            assert off % ALIGN == 0 and off >= prev_end  # aligned, no two chunks overlap


def test_a_piece_that_would_pass_the_end_starts_the_ring_again_at_zero():
    pieces = plan([1000] * 5, staging=3000, piece=1000)  # a third chunk would end at 3048
    assert [p.start for p in pieces] == [0, 1024, 0, 1024, 0]


def test_host_piece_target_is_the_whole_call_or_the_whole_buffer():
    mib = 1024**2
    assert pipeline.host_piece_target(32 * mib, 32 * mib + 4096) == 32 * mib
    assert pipeline.host_piece_target(100, 64 * mib) == 100
    assert pipeline.host_piece_target(256 * mib, 64 * mib) == 64 * mib
    pieces = plan([mib] * 8, staging=8 * mib, piece=pipeline.host_piece_target(8 * mib, 8 * mib))
    assert len(pieces) == 1 and pieces[0].end == 8 * mib


def test_piece_target_cuts_small_calls_and_leaves_two_pieces_room_in_staging():
    mib = 1024**2
    assert pipeline.piece_target(64 * mib, 64 * mib) == pipeline.PIECE_BYTES
    assert pipeline.piece_target(4 * mib, 64 * mib) == 2 * mib  # MIN_PIECES pieces
    assert pipeline.piece_target(100, 64 * mib) == pipeline.MIN_PIECE_BYTES
    assert pipeline.piece_target(64 * mib, 6 * mib) == 3 * mib


class StandIn:
    """Records the schedule: which staging ranges are busy, how many requests are in flight."""

    def __init__(self, rng, fail=None):
        self.rng, self.fail = rng, fail
        self.busy = []  # pieces sent or gathered and not yet finished
        self.sent, self.received, self.max_flight = {}, [], 0

    def before(self, piece):
        for other in self.busy:
            assert not (other.start < piece.end and piece.start < other.end), \
                "a piece's range was reused while an earlier piece using it was unfinished"
        self.busy.append(piece)

    def send(self, piece):
        rid = len(self.sent) + 1
        self.sent[rid] = piece
        self.max_flight = max(self.max_flight, len(self.sent) - len(self.received))
        return rid

    def receive(self, rid):
        self.received.append(rid)
        if self.fail is not None and self.sent[rid] is self.fail[0]:
            raise self.fail[1]
        return {"results": [self.rng.random() < 0.5 for _ in self.sent[rid].slots]}

    def after(self, piece, header):
        self.busy.remove(piece)
        return [(c.key, ok) for (c, _), ok in zip(piece.slots, header["results"])]


@pytest.mark.parametrize("roomy", [True, False])
@pytest.mark.parametrize("depth", [1, 2, 3])
@pytest.mark.parametrize("seed", range(3))
def test_run_never_reuses_a_busy_range_and_keeps_results_in_chunk_order(seed, depth, roomy):
    rng = random.Random(seed)
    sizes = [rng.randrange(100, 3000) for _ in range(40)]
    staging = 3 * 3000 + 4 * ALIGN if roomy else 3000 + 2 * ALIGN  # tight: the ring laps often
    pieces = plan(sizes, staging, piece=rng.randrange(1000, 5000))
    stand_in = StandIn(rng)
    results = pipeline.run(pieces, depth, stand_in.before, stand_in.send, stand_in.receive,
                           stand_in.after)
    assert [key for key, _ in results] == [b"k%d" % i for i in range(len(sizes))]
    assert stand_in.max_flight <= depth and not stand_in.busy
    if depth > 1 and roomy:
        assert stand_in.max_flight >= 2  # the overlap really happens


def test_a_refused_piece_is_raised_after_the_replies_still_owed_are_read():
    pieces = plan([1000] * 6, staging=1 << 20, piece=1000)
    error = DaemonError(Op.PUT, Status.BAD_REQUEST, "BAD_REQUEST", "refused")
    stand_in = StandIn(random.Random(0), fail=(pieces[2], error))
    with pytest.raises(DaemonError, match="refused"):
        pipeline.run(pieces, 2, stand_in.before, stand_in.send, stand_in.receive, stand_in.after)
    # piece 3 was in flight when piece 2 failed: its reply is read before the error goes up,
    # so no daemon copy still uses the staging buffer when the caller reuses it
    assert sorted(stand_in.received) == sorted(stand_in.sent) == [1, 2, 3, 4]


def test_a_timeout_is_raised_at_once_without_waiting_for_the_others():
    pieces = plan([1000] * 6, staging=1 << 20, piece=1000)
    stand_in = StandIn(random.Random(0), fail=(pieces[2], DaemonUnavailable("timed out")))
    with pytest.raises(DaemonUnavailable):
        pipeline.run(pieces, 2, stand_in.before, stand_in.send, stand_in.receive, stand_in.after)
    assert stand_in.received == [1, 2, 3]  # the session is dropped: nothing more is awaited
