"""Lease expiry over a real CPU tier: a lease taken again moves to the back (leases stay in expiry
order), ``expire`` releases exactly the leases past their expiry, and the pins follow."""

from __future__ import annotations

import uuid

import pytest

from kvtierd.protocol import Status
from kvtierd.server import sessions as sessions_mod
from kvtierd.server.sessions import Session, SessionTable
from kvtierd.tiers.arena import Arena
from kvtierd.tiers.cpu import CpuTier

PAGE = 4096
SPACE = ("uid:1000", "ns", 0)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def tier(request):
    arena = Arena(name=f"kvtierd-test-{uuid.uuid4().hex}", nbytes=64 * PAGE, prefault=False,
                  lock=False)
    request.addfinalizer(lambda: arena.close(unlink=True))
    return CpuTier(arena, PAGE)


def stored(tier: CpuTier, keys: list[bytes]) -> list:
    entries = []
    for key in keys:
        status, entry = tier.reserve((SPACE, key), "fp", PAGE, owner=1)
        assert status is Status.OK
        tier.commit(entry, b"\0" * 16)
        entries.append(entry)
    return entries


def test_a_lease_taken_again_outlives_older_ones_and_expiry_follows_the_clock(tier,
                                                                             monkeypatch):
    clock = Clock()
    monkeypatch.setattr(sessions_mod.time, "monotonic", clock)
    table = SessionTable(tier, timeout_s=1e9, lease_timeout_s=10.0)
    session = Session(b"id", SPACE[0], SPACE[1], SPACE[2], 1, "fp", None, {})
    table.add(session)
    a, b, c = stored(tier, [b"a", b"b", b"c"])
    for entry in (a, b, c):
        table.lease(session, entry)
    clock.now += 4.0
    table.lease(session, a)  # again: expires at +14, after b and c (+10)
    assert list(session.leases) == [b.ikey, c.ikey, a.ikey]
    assert (a.pin_count, b.pin_count, c.pin_count) == (1, 1, 1), "a second lease pins no more"
    table.check_invariants()
    clock.now += 5.9  # +9.9: nothing expired
    table.expire()
    assert len(session.leases) == 3
    clock.now += 0.1  # +10: b and c expire, a does not
    table.expire()
    assert list(session.leases) == [a.ikey] and (b.pin_count, c.pin_count) == (0, 0)
    assert a.pin_count == 1
    table.lease(session, b)  # a new lease after a renewed one: still in expiry order
    table.check_invariants()
    clock.now += 4.0  # +14: a expires, b (+20) stays
    table.expire()
    assert list(session.leases) == [b.ikey] and a.pin_count == 0 and b.pin_count == 1
    table.release_lease(session, b.ikey)
    assert not session.leases and b.pin_count == 0
    table.check_invariants()
